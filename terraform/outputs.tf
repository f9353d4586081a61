output "gateway_url" {
  description = "Send requests here (POST {url}v1/models/{model}/requests with an API key)."
  value       = aws_lambda_function_url.gateway.function_url
}

output "redis_url" {
  description = "BATCHGATE_REDIS_URL for `batchgate keys create` and other operations inside the VPC (sensitive: `terraform output -raw redis_url`)."
  value       = local.redis_url
  sensitive   = true
}

output "worker_asg_name" {
  value = aws_autoscaling_group.workers.name
}

output "key_prefix" {
  value = var.name
}

output "files_bucket" {
  description = "The S3 bucket of the Files and Batch APIs (BATCHGATE_FILES_S3_BUCKET)."
  value       = aws_s3_bucket.files.bucket
}
