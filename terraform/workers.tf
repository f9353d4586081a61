locals {
  asg_name  = "${var.name}-workers"
  hook_name = "${var.name}-drain"
}

resource "aws_iam_role" "worker" {
  name               = "${var.name}-worker"
  assume_role_policy = data.aws_iam_policy_document.assume["ec2"].json
}

data "aws_iam_policy_document" "worker" {
  statement {
    sid       = "FinishOwnDrain"
    actions   = ["autoscaling:CompleteLifecycleAction"]
    resources = [aws_autoscaling_group.workers.arn]
  }
}

resource "aws_iam_role_policy" "worker" {
  name   = "${var.name}-worker"
  role   = aws_iam_role.worker.id
  policy = data.aws_iam_policy_document.worker.json
}

# Session Manager and Run Command on the workers: the operators' way into the VPC (the first API key, tenants,
# webhooks: `batchgate keys create ...`), with no inbound port and no SSH key.
resource "aws_iam_role_policy_attachment" "worker_ssm" {
  role       = aws_iam_role.worker.name
  policy_arn = "arn:aws:iam::aws:policy/AmazonSSMManagedInstanceCore"
}

resource "aws_iam_instance_profile" "worker" {
  name = "${var.name}-worker"
  role = aws_iam_role.worker.name
}

resource "aws_launch_template" "worker" {
  name_prefix            = "${var.name}-worker-"
  image_id               = var.worker_ami_id
  vpc_security_group_ids = [aws_security_group.outbound_only["workers"].id]
  update_default_version = true
  iam_instance_profile {
    arn = aws_iam_instance_profile.worker.arn
  }
  metadata_options {
    http_tokens                 = "required" # IMDSv2 only
    http_put_response_hop_limit = 1
    instance_metadata_tags      = "disabled"
  }
  block_device_mappings {
    device_name = "/dev/sda1"
    ebs {
      volume_size = var.worker_volume_gb
      volume_type = "gp3"
      encrypted   = true
    }
  }
  user_data = base64encode(templatefile("${path.module}/templates/worker_user_data.sh.tftpl", {
    pip_spec       = var.batchgate_pip_spec
    models_yaml    = var.models_yaml
    env            = local.base_env
    drain_budget_s = var.drain_budget_s
    asg_name       = local.asg_name
    hook_name      = local.hook_name
  }))
  tag_specifications {
    resource_type = "instance"
    tags          = { Name = "${var.name}-worker" }
  }
}

resource "aws_autoscaling_group" "workers" {
  name                      = local.asg_name
  min_size                  = var.worker_min
  max_size                  = var.worker_max
  vpc_zone_identifier       = var.subnet_ids
  health_check_type         = "EC2"
  health_check_grace_period = 900 # driver start, pip install and model load
  capacity_rebalance        = var.worker_spot
  enabled_metrics           = ["GroupInServiceInstances", "GroupDesiredCapacity"]
  metrics_granularity       = "1Minute"

  mixed_instances_policy {
    instances_distribution {
      on_demand_base_capacity                  = 0
      on_demand_percentage_above_base_capacity = var.worker_spot ? 0 : 100
      spot_allocation_strategy                 = "price-capacity-optimized"
    }
    launch_template {
      launch_template_specification {
        launch_template_id = aws_launch_template.worker.id
        version            = "$Latest"
      }
      dynamic "override" {
        for_each = var.worker_instance_types
        content {
          instance_type = override.value
        }
      }
    }
  }

  # Scale-in waits for the drain: the instance stays in Terminating:Wait until the lifecycle script
  # on it has stopped the worker (SIGTERM -> finish or hand back), or the heartbeat runs out.
  initial_lifecycle_hook {
    name                 = local.hook_name
    lifecycle_transition = "autoscaling:EC2_INSTANCE_TERMINATING"
    default_result       = "CONTINUE"
    heartbeat_timeout    = var.drain_budget_s + 60
  }

  tag {
    key                 = "Name"
    value               = "${var.name}-worker"
    propagate_at_launch = true
  }

  lifecycle {
    ignore_changes = [desired_capacity] # autoscaling owns it
  }
}
