variable "name" {
  description = "Deployment name: prefix of every resource, the Redis key prefix and the CloudWatch dimension."
  type        = string
  default     = "batchgate"
  validation {
    # ElastiCache's replication group id, which it names, takes no "--" and no "-" at the end
    condition     = can(regex("^[a-z][a-z0-9-]{1,30}$", var.name)) && !strcontains(var.name, "--") && !endswith(var.name, "-")
    error_message = "name: 2-31 lower-case letters, digits or '-', starting with a letter, with no '--' and no '-' at the end."
  }
}

variable "aws_region" {
  description = "The AWS region of the deployment."
  type        = string
  default     = "us-east-1"
}

variable "aws_endpoint_url" {
  description = "Tests only: send every AWS call to this endpoint (a moto server on loopback)."
  type        = string
  default     = null
}

variable "tags" {
  description = "Tags added to every resource that takes tags."
  type        = map(string)
  default     = {}
}

# --- network ---------------------------------------------------------------------------------

variable "vpc_id" {
  description = "The VPC that holds Redis, the workers and the gateway Lambda."
  type        = string
}

variable "subnet_ids" {
  description = "Private subnets (at least two, in different zones) for Redis, workers and the Lambdas. They need a route to the internet or VPC endpoints for pip, CloudWatch, Auto Scaling and S3 (the files bucket)."
  type        = list(string)
  validation {
    condition     = length(var.subnet_ids) >= 2
    error_message = "Give at least two subnets in different availability zones."
  }
}

# --- Redis (ElastiCache) ---------------------------------------------------------------------

variable "redis_url" {
  description = "An existing Redis (7.0+, maxmemory-policy noeviction; a cluster as redis+cluster:// or rediss+cluster://) to use instead of creating ElastiCache, e.g. rediss://:password@host:6379/0. It must accept connections from the subnets."
  type        = string
  default     = null
  sensitive   = true # it may carry a password: kept out of plan output
  validation {
    condition     = var.redis_url == null || can(regex("^rediss?(\\+cluster)?://[^/]", var.redis_url))
    error_message = "redis_url is a Redis URL: redis://, rediss://, redis+cluster:// or rediss+cluster://, then the host."
  }
}

variable "redis_node_type" {
  description = "ElastiCache node type of the primary and replicas (when redis_url is not given)."
  type        = string
  default     = "cache.r7g.large"
}

variable "redis_replicas" {
  description = "Read replicas beside the primary; with one or more, failover is automatic and Multi-AZ."
  type        = number
  default     = 1
}

variable "redis_engine_version" {
  description = "ElastiCache Redis engine version (7.0 or later: the scripts use its commands)."
  type        = string
  default     = "7.1"
}

# --- GPU workers -----------------------------------------------------------------------------

variable "worker_ami_id" {
  description = "An AMI with NVIDIA drivers, Python 3.11+ and the AWS CLI, e.g. the AWS Deep Learning Base GPU AMI of your region."
  type        = string
}

variable "worker_instance_types" {
  description = "GPU instance types the Auto Scaling group may launch (first is preferred for on-demand)."
  type        = list(string)
  default     = ["g5.xlarge", "g6.xlarge"]
}

variable "worker_spot" {
  description = "Run workers on Spot: the 2-minute notice triggers the same drain as a scale-in."
  type        = bool
  default     = false
}

variable "worker_min" {
  description = "Fewest workers the Auto Scaling group keeps (0: none while there is nothing to do; the scaler starts the first)."
  type        = number
  default     = 0
  validation {
    condition     = var.worker_min >= 0 && var.worker_min <= var.worker_max
    error_message = "worker_min is at least 0 and at most worker_max."
  }
}

variable "worker_max" {
  description = "Most workers the Auto Scaling group may run."
  type        = number
  default     = 4
  validation {
    condition     = var.worker_max >= 1
    error_message = "worker_max is at least 1: no worker would ever run."
  }
}

variable "worker_volume_gb" {
  description = "Size of each worker's encrypted gp3 root volume (the AMI, the virtual environment, the model weights)."
  type        = number
  default     = 100
}

variable "batchgate_pip_spec" {
  description = "What the workers pip-install: a version, a wheel URL (e.g. a presigned S3 URL) or a git URL, with the worker extra."
  type        = string
  default     = "batchgate[worker,aws]==0.1.0" # aws: boto3, for the files bucket
}

variable "models_yaml" {
  description = "The models file (README: Configuration) given to workers and gateway; empty: the built-in models."
  type        = string
  default     = ""
  validation {
    condition     = var.models_yaml == "" || can(keys(yamldecode(var.models_yaml)))
    error_message = "models_yaml is YAML of a mapping, e.g. a top-level models: list (README: Configuration)."
  }
  validation {
    # the Lambdas take it inline, and AWS limits a function's environment to 4 KB in all (the Redis URL, bucket and
    # the rest take the remainder): an apply would fail at the first Lambda
    condition     = length(var.models_yaml) <= 3000
    error_message = "models_yaml is at most 3,000 characters: the Lambdas take it in their environment, which AWS limits to 4 KB in all (leave its comments out)."
  }
}

variable "drain_budget_s" {
  description = "How long a stopping worker may finish running sequences before handing the rest back."
  type        = number
  default     = 90
  validation {
    condition     = var.drain_budget_s >= 0
    error_message = "drain_budget_s is a number of seconds, at least 0."
  }
}

variable "backlog_per_worker_target" {
  description = "Autoscaling target: requests waiting or running per in-service worker (acceptable queue time / time per request x batch)."
  type        = number
  default     = 64
}

# --- gateway (Lambda) ------------------------------------------------------------------------

variable "gateway_zip" {
  description = "The gateway Lambda package built by scripts/build_lambda_zip.sh (no torch)."
  type        = string
}

variable "gateway_memory_mb" {
  description = "Memory of the gateway Lambdas (HTTP and SQS), which also sets their CPU share."
  type        = number
  default     = 512
}

variable "gateway_timeout_s" {
  description = "Lambda timeout; sync waits (?wait=S) are capped below it."
  type        = number
  default     = 30
}

variable "gateway_url_auth" {
  description = "Function URL auth: NONE (batchgate API keys do the auth) or AWS_IAM (callers sign with SigV4 as well)."
  type        = string
  default     = "NONE"
  validation {
    condition     = contains(["NONE", "AWS_IAM"], var.gateway_url_auth)
    error_message = "gateway_url_auth is NONE or AWS_IAM."
  }
}

variable "result_ttl_s" {
  description = "How long a finished request's record (its result) is kept in Redis."
  type        = number
  default     = 86400
}

variable "sqs_queue_arn" {
  description = "An SQS queue whose messages ({model, input, params, ...}) are submitted by the gateway's sqs_handler; empty: none."
  type        = string
  default     = ""
}

variable "lambda_tenant" {
  description = "The tenant the SQS Lambda's messages act for, unless a message carries its own api_key (whose tenant it then acts for)."
  type        = string
  default     = "default"
  validation {
    # the gateway's own rule (shared/tenants.py): the SQS Lambda failed at import on every message otherwise
    condition     = can(regex("^[^\\p{C}\\p{Z}:]{1,128}$", var.lambda_tenant))
    error_message = "lambda_tenant is a tenant name: 1-128 characters, no spaces, control characters or ':'."
  }
}

variable "sqs_batch_size" {
  description = "Messages the SQS Lambda takes per invocation (its partial batch failures are redelivered alone)."
  type        = number
  default     = 10
}

# --- files (the Files and Batch APIs) ---------------------------------------------------------

variable "files_bucket_name" {
  description = "Name of the S3 bucket created for uploaded and batch output files; null: <name>-files-<account id>."
  type        = string
  default     = null
}

variable "files_force_destroy" {
  description = "Let `terraform destroy` delete the files bucket although it holds files."
  type        = bool
  default     = false
}
