from tests.redis_support import client_kind, redis_client, redis_server, restartable_redis  # noqa: F401  (fixtures)
