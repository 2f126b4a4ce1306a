"""`mili`, the command line: a front end over the client library, as the gateway is one over HTTP.
The parser and the error lines (__main__), the producer's commands (client_commands), the
operator's (operator_commands), and `mili batch` (batch_command, whose runner, batch_file, reads
OpenAI's batch lines with openai_format, as the gateway does). Nothing of ours imports this
package, and it imports nothing of the gateway's."""
