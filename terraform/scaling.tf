# Scale on backlog per in-service worker (RELIABILITY.md): a scheduled Lambda publishes the backlog
# (it sees it with zero workers running), a target-tracking policy keeps backlog / workers near the
# target, and a simple policy starts the first worker when there is a backlog and none is running.

resource "aws_lambda_function" "scaler" {
  function_name    = "${var.name}-scaler"
  role             = aws_iam_role.lambda["scaler"].arn
  runtime          = "python3.11"
  handler          = "gateway.scaling_handler.handler"
  filename         = var.gateway_zip
  source_code_hash = filebase64sha256(var.gateway_zip)
  memory_size      = 256
  timeout          = 30
  vpc_config {
    subnet_ids         = var.subnet_ids
    security_group_ids = [aws_security_group.outbound_only["lambdas"].id]
  }
  environment {
    variables = merge(local.lambda_env, { BATCHGATE_DEPLOYMENT = var.name })
  }
}

resource "aws_cloudwatch_event_rule" "scaler" {
  name                = "${var.name}-scaler"
  description         = "Publish the batchgate backlog for worker autoscaling"
  schedule_expression = "rate(1 minute)"
}

resource "aws_cloudwatch_event_target" "scaler" {
  rule = aws_cloudwatch_event_rule.scaler.name
  arn  = aws_lambda_function.scaler.arn
}

resource "aws_lambda_permission" "scaler" {
  statement_id  = "AllowEventBridge"
  action        = "lambda:InvokeFunction"
  function_name = aws_lambda_function.scaler.function_name
  principal     = "events.amazonaws.com"
  source_arn    = aws_cloudwatch_event_rule.scaler.arn
}

resource "aws_autoscaling_policy" "backlog_per_worker" {
  name                   = "${var.name}-backlog-per-worker"
  autoscaling_group_name = aws_autoscaling_group.workers.name
  policy_type            = "TargetTrackingScaling"
  target_tracking_configuration {
    target_value = var.backlog_per_worker_target
    customized_metric_specification {
      metrics {
        id          = "backlog"
        return_data = false
        metric_stat {
          stat = "Average"
          metric {
            namespace   = "batchgate"
            metric_name = "Backlog"
            dimensions {
              name  = "Deployment"
              value = var.name
            }
          }
        }
      }
      metrics {
        id          = "workers"
        return_data = false
        metric_stat {
          stat = "Average"
          metric {
            namespace   = "AWS/AutoScaling"
            metric_name = "GroupInServiceInstances"
            dimensions {
              name  = "AutoScalingGroupName"
              value = aws_autoscaling_group.workers.name
            }
          }
        }
      }
      metrics {
        id          = "per_worker"
        label       = "batchgate backlog per in-service worker"
        expression  = "backlog / IF(workers > 0, workers, 1)"
        return_data = true
      }
    }
  }
}

resource "aws_autoscaling_policy" "first_worker" {
  name                   = "${var.name}-first-worker"
  autoscaling_group_name = aws_autoscaling_group.workers.name
  policy_type            = "SimpleScaling"
  adjustment_type        = "ExactCapacity"
  scaling_adjustment     = 1
  cooldown               = 300
}

resource "aws_cloudwatch_metric_alarm" "backlog_without_workers" {
  alarm_name          = "${var.name}-backlog-without-workers"
  alarm_description   = "Requests are waiting and no batchgate worker is in service"
  comparison_operator = "GreaterThanOrEqualToThreshold"
  threshold           = 1
  evaluation_periods  = 1
  treat_missing_data  = "notBreaching"
  alarm_actions       = [aws_autoscaling_policy.first_worker.arn]
  metric_query {
    id          = "stranded"
    expression  = "IF(backlog > 0 AND workers == 0, 1, 0)"
    label       = "backlog with no worker"
    return_data = true
  }
  metric_query {
    id = "backlog"
    metric {
      namespace   = "batchgate"
      metric_name = "Backlog"
      period      = 60
      stat        = "Maximum"
      dimensions  = { Deployment = var.name }
    }
  }
  metric_query {
    id = "workers"
    metric {
      namespace   = "AWS/AutoScaling"
      metric_name = "GroupInServiceInstances"
      period      = 60
      stat        = "Maximum"
      dimensions  = { AutoScalingGroupName = aws_autoscaling_group.workers.name }
    }
  }
}
