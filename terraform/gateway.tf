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

# A role per Lambda, each with what its function does and no more: the gateway (public, behind its Function URL)
# reads and writes the files bucket; the scaler publishes the backlog metric; the SQS Lambda reads its queue. All
# three reach Redis in the VPC.
locals {
  lambda_roles = toset(concat(["gateway", "scaler"], var.sqs_queue_arn == "" ? [] : ["sqs"]))
}

resource "aws_iam_role" "lambda" {
  for_each           = local.lambda_roles
  name               = "${var.name}-${each.key}-lambda"
  assume_role_policy = data.aws_iam_policy_document.assume["lambda"].json
}

resource "aws_iam_role_policy_attachment" "lambda_vpc" {
  for_each   = local.lambda_roles
  role       = aws_iam_role.lambda[each.key].name
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
  role   = aws_iam_role.lambda["scaler"].id
  policy = data.aws_iam_policy_document.lambda_metrics.json
}

# The HTTP API: the Starlette app through Mangum (gateway/lambda_handler.py), behind a Function URL.
# The same package also has `direct_handler` (aws lambda invoke) and `sqs_handler` entry points.
resource "aws_lambda_function" "gateway" {
  function_name    = "${var.name}-gateway"
  role             = aws_iam_role.lambda["gateway"].arn
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

# A Function URL without IAM auth answers only if the function's policy lets anyone call it through the URL
# (the console adds this; the API and Terraform do not), and, for URLs created since October 2025, lets anyone
# invoke the function too. batchgate's API keys authenticate every request the handler serves.
resource "aws_lambda_permission" "gateway_url_public" {
  for_each = var.gateway_url_auth == "NONE" ? toset(["InvokeFunctionUrl", "InvokeFunction"]) : toset([])

  statement_id           = "BatchgatePublic${each.key}"
  action                 = "lambda:${each.key}"
  function_name          = aws_lambda_function.gateway.function_name
  principal              = "*"
  function_url_auth_type = each.key == "InvokeFunctionUrl" ? "NONE" : null
}
