# Optional: an SQS queue feeding the gateway's `sqs_handler` (one batch submit per model). A message
# that was not accepted is reported in `batchItemFailures`, so SQS retries that message alone; the
# mapping must ask for that report, or one refused message would redeliver (and finally dead-letter)
# the whole batch, the accepted messages included.
# What the event source mapping needs of this queue alone (AWS's AWSLambdaSQSQueueExecutionRole grants it on
# every queue of the account).
data "aws_iam_policy_document" "lambda_sqs" {
  count = var.sqs_queue_arn == "" ? 0 : 1
  statement {
    actions   = ["sqs:ReceiveMessage", "sqs:DeleteMessage", "sqs:GetQueueAttributes"]
    resources = [var.sqs_queue_arn]
  }
}

resource "aws_iam_role_policy" "lambda_sqs" {
  count  = var.sqs_queue_arn == "" ? 0 : 1
  name   = "${var.name}-sqs"
  role   = aws_iam_role.lambda["sqs"].id
  policy = data.aws_iam_policy_document.lambda_sqs[0].json
}

resource "aws_lambda_function" "sqs" {
  count            = var.sqs_queue_arn == "" ? 0 : 1
  function_name    = "${var.name}-sqs"
  role             = aws_iam_role.lambda["sqs"].arn
  runtime          = "python3.11"
  handler          = "gateway.lambda_handler.sqs_handler"
  filename         = var.gateway_zip
  source_code_hash = filebase64sha256(var.gateway_zip)
  memory_size      = var.gateway_memory_mb
  timeout          = var.gateway_timeout_s
  vpc_config {
    subnet_ids         = var.subnet_ids
    security_group_ids = [aws_security_group.outbound_only["lambdas"].id]
  }
  environment {
    variables = merge(local.lambda_env, { BATCHGATE_AUTH = "api_key", BATCHGATE_LAMBDA_TENANT = var.lambda_tenant })
  }
}

resource "aws_lambda_event_source_mapping" "sqs" {
  count                   = var.sqs_queue_arn == "" ? 0 : 1
  event_source_arn        = var.sqs_queue_arn
  function_name           = aws_lambda_function.sqs[0].arn
  batch_size              = var.sqs_batch_size
  function_response_types = ["ReportBatchItemFailures"]
}
