# who may assume the workers' and the Lambdas' roles
data "aws_iam_policy_document" "assume" {
  for_each = toset(["ec2", "lambda"])
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["${each.key}.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "lambda" {
  name               = "${var.name}-lambda"
  assume_role_policy = data.aws_iam_policy_document.assume["lambda"].json
}

resource "aws_iam_role_policy_attachment" "lambda_vpc" {
  role       = aws_iam_role.lambda.name
  policy_arn = "arn:aws:iam::aws:policy/service-role/AWSLambdaVPCAccessExecutionRole"
}

data "aws_iam_policy_document" "lambda_metrics" {
  statement {
    actions   = ["cloudwatch:PutMetricData"]
    resources = ["*"] # PutMetricData has no resource-level permissions; the condition scopes it
    condition {
      test     = "StringEquals"
      variable = "cloudwatch:namespace"
      values   = ["batchgate"]
    }
  }
}

resource "aws_iam_role_policy" "lambda_metrics" {
  name   = "${var.name}-metrics"
  role   = aws_iam_role.lambda.id
  policy = data.aws_iam_policy_document.lambda_metrics.json
}

# The HTTP API: the Starlette app through Mangum (gateway/lambda_handler.py), behind a Function URL.
# The same package also has `direct_handler` (aws lambda invoke) and `sqs_handler` entry points.
resource "aws_lambda_function" "gateway" {
  function_name    = "${var.name}-gateway"
  role             = aws_iam_role.lambda.arn
  runtime          = "python3.11"
  handler          = "gateway.lambda_handler.http_handler"
  filename         = var.gateway_zip
  source_code_hash = filebase64sha256(var.gateway_zip)
  memory_size      = var.gateway_memory_mb
  timeout          = var.gateway_timeout_s
  vpc_config {
    subnet_ids         = var.subnet_ids
    security_group_ids = [aws_security_group.outbound_only["lambdas"].id]
  }
  environment {
    variables = merge(local.lambda_env, {
      BATCHGATE_AUTH       = "api_key"
      BATCHGATE_MAX_WAIT_S = tostring(max(1, var.gateway_timeout_s - 3))
    })
  }
}

resource "aws_lambda_function_url" "gateway" {
  function_name      = aws_lambda_function.gateway.function_name
  authorization_type = var.gateway_url_auth
}
