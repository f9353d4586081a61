terraform {
  required_version = ">= 1.9" # a variable's validation names another variable (worker_min <= worker_max)
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.40, < 6.0"
    }
  }
}

provider "aws" {
  region = var.aws_region

  # Tests point every service at a fake AWS API (moto) on loopback; a real deployment leaves this null.
  skip_credentials_validation = var.aws_endpoint_url != null
  skip_requesting_account_id  = var.aws_endpoint_url != null
  skip_metadata_api_check     = var.aws_endpoint_url != null
  s3_use_path_style           = var.aws_endpoint_url != null # moto serves buckets by path

  dynamic "endpoints" {
    for_each = var.aws_endpoint_url == null ? [] : [var.aws_endpoint_url]
    content {
      autoscaling = endpoints.value
      cloudwatch  = endpoints.value
      ec2         = endpoints.value
      elasticache = endpoints.value
      events      = endpoints.value
      iam         = endpoints.value
      lambda      = endpoints.value
      logs        = endpoints.value
      s3          = endpoints.value
      sts         = endpoints.value
    }
  }

  default_tags {
    tags = merge({ "batchgate:deployment" = var.name }, var.tags)
  }
}
