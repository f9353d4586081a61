# The file store of the Files and Batch APIs (docs/batches.md): uploaded batch inputs and the outputs
# batchgate writes. The gateway Lambda and the workers get its name as BATCHGATE_FILES_S3_BUCKET (main.tf).
# Objects are kept until deleted through the API (their records in Redis do not expire either).

data "aws_caller_identity" "current" {}
data "aws_partition" "current" {}

locals {
  files_bucket = coalesce(var.files_bucket_name, "${var.name}-files-${data.aws_caller_identity.current.account_id}")
  files_arn    = "arn:${data.aws_partition.current.partition}:s3:::${local.files_bucket}" # known at plan time
}

resource "aws_s3_bucket" "files" {
  bucket        = local.files_bucket
  force_destroy = var.files_force_destroy
}

resource "aws_s3_bucket_public_access_block" "files" {
  bucket                  = aws_s3_bucket.files.id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_ownership_controls" "files" {
  bucket = aws_s3_bucket.files.id
  rule {
    object_ownership = "BucketOwnerEnforced" # no ACLs: access is the roles' policies alone
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "files" {
  bucket = aws_s3_bucket.files.id
  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm = "AES256"
    }
  }
}

resource "aws_s3_bucket_lifecycle_configuration" "files" {
  bucket = aws_s3_bucket.files.id
  # an upload cut off mid-way (a gateway that died) leaves the parts of its multipart upload: drop them
  rule {
    id     = "abort-incomplete-uploads"
    status = "Enabled"
    filter {}
    abort_incomplete_multipart_upload {
      days_after_initiation = 1
    }
  }
}

# What the gateway Lambda and the workers may do with the files: read, write, delete objects (ListBucket
# makes a missing object a 404, not a 403).
data "aws_iam_policy_document" "files" {
  statement {
    sid       = "FileObjects"
    actions   = ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"]
    resources = ["${local.files_arn}/*"]
  }
  statement {
    sid       = "FileBucket"
    actions   = ["s3:ListBucket"]
    resources = [local.files_arn]
  }
}

resource "aws_iam_role_policy" "lambda_files" {
  name   = "${var.name}-files"
  role   = aws_iam_role.lambda["gateway"].id
  policy = data.aws_iam_policy_document.files.json
}

resource "aws_iam_role_policy" "worker_files" {
  name   = "${var.name}-worker-files"
  role   = aws_iam_role.worker.id
  policy = data.aws_iam_policy_document.files.json
}
