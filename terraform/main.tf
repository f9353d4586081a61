locals {
  # what the worker and the Lambdas share
  own_redis = var.redis_url == null
  redis_url = local.own_redis ? "rediss://${aws_elasticache_replication_group.redis[0].primary_endpoint_address}:6379/0" : var.redis_url
  base_env = {
    BATCHGATE_REDIS_URL    = local.redis_url
    BATCHGATE_KEY_PREFIX   = var.name
    BATCHGATE_RESULT_TTL_S = tostring(var.result_ttl_s)
    BATCHGATE_LOG_FORMAT   = "json"
    # the Files and Batch APIs' store (files.tf)
    BATCHGATE_FILES_S3_BUCKET = aws_s3_bucket.files.bucket
  }
  # Lambdas take the models file inline (no file system to ship it in); workers get it as a file
  lambda_env = merge(local.base_env, var.models_yaml == "" ? {} : { BATCHGATE_CONFIG_YAML = var.models_yaml })
}

# --- security groups: Redis takes connections from the workers and the Lambdas only ------------

resource "aws_security_group" "outbound_only" {
  for_each = {
    workers = "batchgate GPU workers (outbound only)"
    lambdas = "batchgate gateway and scaler Lambdas (outbound only)"
  }
  name        = "${var.name}-${each.key}"
  description = each.value
  vpc_id      = var.vpc_id
  egress {
    from_port   = 0
    to_port     = 0
    protocol    = "-1"
    cidr_blocks = ["0.0.0.0/0"]
  }
}

resource "aws_security_group" "redis" {
  count       = local.own_redis ? 1 : 0
  name        = "${var.name}-redis"
  description = "batchgate Redis: 6379 from workers and Lambdas"
  vpc_id      = var.vpc_id
  ingress {
    description     = "Redis from batchgate workers and Lambdas"
    from_port       = 6379
    to_port         = 6379
    protocol        = "tcp"
    security_groups = [for sg in aws_security_group.outbound_only : sg.id]
  }
}
