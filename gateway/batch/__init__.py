"""OpenAI's Files and Batch API on the gateway: the API's shapes (schema), where files and batches
live in Redis (store), the HTTP routes (routes), and the driver that runs a batch's lines as queue
jobs under a lease (driver). The line format is openai_format.batch_lines, which `mili batch`
(cli.batch_file) reads and answers from local files."""
