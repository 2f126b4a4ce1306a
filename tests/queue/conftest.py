from tests.redis_support import client_kind, redis_client, redis_server  # noqa: F401  (fixtures)
