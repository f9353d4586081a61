# One non-cluster replication group (primary and replicas, automatic failover): what one deployment needs up to
# its control plane's ceiling (docs/architecture.md). batchgate also runs on a Redis Cluster, every script within
# one hash slot: point `redis_url` at one (redis+cluster://) to go past it.
# Not created when `redis_url` names an existing Redis.

resource "aws_elasticache_subnet_group" "redis" {
  count = local.own_redis ? 1 : 0

  name       = "${var.name}-redis"
  subnet_ids = var.subnet_ids
}

resource "aws_elasticache_parameter_group" "redis" {
  count = local.own_redis ? 1 : 0

  name   = "${var.name}-redis7"
  family = "redis7"
  # ElastiCache's default (volatile-lru) evicts keys that have a TTL under memory pressure: result
  # records would vanish early. With noeviction a full Redis refuses writes instead, and the gateway
  # answers 503 with Retry-After; nothing accepted is dropped silently.
  parameter {
    name  = "maxmemory-policy"
    value = "noeviction"
  }
}

resource "aws_elasticache_replication_group" "redis" {
  count = local.own_redis ? 1 : 0

  replication_group_id       = "${var.name}-redis"
  description                = "batchgate lane streams, results and callbacks"
  engine                     = "redis"
  engine_version             = var.redis_engine_version
  node_type                  = var.redis_node_type
  num_cache_clusters         = 1 + var.redis_replicas
  automatic_failover_enabled = var.redis_replicas > 0
  multi_az_enabled           = var.redis_replicas > 0
  parameter_group_name       = aws_elasticache_parameter_group.redis[0].name
  subnet_group_name          = aws_elasticache_subnet_group.redis[0].name
  security_group_ids         = [aws_security_group.redis[0].id]
  port                       = 6379
  transit_encryption_enabled = true
  at_rest_encryption_enabled = true
  snapshot_retention_limit   = 1
  apply_immediately          = false
}
