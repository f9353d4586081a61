"""The Terraform in terraform/: formatted, valid, and planned against a fake AWS API (moto, loopback).

What the plan is checked for is what the deployment promises: Redis that never evicts, workers that
drain before an instance goes, scaling on backlog per worker (and from zero), the gateway Lambda with
auth on. `terraform apply` (and destroy) runs in test_terraform_apply.py, for an existing Redis only:
moto does not implement ElastiCache parameter groups.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto.server import ThreadedMotoServer

from shared.embedded_redis import free_port

REPO_TF = Path(__file__).resolve().parents[2] / "terraform"
PLUGIN_DIR = Path(os.environ.get("BATCHGATE_TF_PLUGIN_DIR", "/opt/tf-plugins"))
MODELS_YAML = "models:\n  - name: tiny-llama\n    max_running: 32\n"
REDIS_URL = "rediss://redis.example.internal:6379/0"
AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def tf(workdir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **AWS_ENV, "TF_IN_AUTOMATION": "1", "CHECKPOINT_DISABLE": "1"}
    env.pop("AWS_PROFILE", None)
    proc = subprocess.run(["terraform", args[0], "-no-color", *args[1:]], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"terraform {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def init_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of terraform/, initialised (offline, from the provider mirror where there is one)."""
    if shutil.which("terraform") is None:  # a requirement of the tests, like the real Redis
        pytest.fail("the Terraform tests need `terraform` on PATH (https://developer.hashicorp.com/terraform/install)")
    work = tmp_path_factory.mktemp("tf") / "terraform"
    shutil.copytree(REPO_TF, work, ignore=shutil.ignore_patterns(".terraform*", "*.tfstate*"))
    init = ["init", "-backend=false", "-input=false"]
    if PLUGIN_DIR.is_dir():  # an offline provider mirror (this project's machines)
        init.append(f"-plugin-dir={PLUGIN_DIR}")
    tf(work, *init)
    return work


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_workdir(tmp_path_factory)


@contextmanager
def moto_account() -> Iterator[dict[str, Any]]:
    """A fresh fake AWS account: moto's server, on 127.0.0.1 only, with a VPC, two subnets and an AMI.

    Like a real account it has the AWS-managed IAM policies (moto leaves them out unless told; `apply`
    attaches AWSLambdaVPCAccessExecutionRole). The server keeps its state in this process's moto
    backends, so it starts with a reset: nothing from another module's fake account.
    """
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MOTO_IAM_LOAD_MANAGED_POLICIES", "true")  # read when the IAM backend is created
        port = free_port()
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        try:
            url = f"http://127.0.0.1:{port}"
            urllib.request.urlopen(urllib.request.Request(f"{url}/moto-api/reset", method="POST"), timeout=30).close()
            ec2 = boto3.client("ec2", endpoint_url=url, region_name="us-east-1", aws_access_key_id="testing",
                               aws_secret_access_key="testing")
            vpc = ec2.create_vpc(CidrBlock="10.40.0.0/16")["Vpc"]["VpcId"]
            subnets = [ec2.create_subnet(VpcId=vpc, CidrBlock=f"10.40.{i}.0/24",
                                         AvailabilityZone=f"us-east-1{zone}")["Subnet"]["SubnetId"]
                       for i, zone in ((1, "a"), (2, "b"))]
            ami = ec2.describe_images()["Images"][0]["ImageId"]
            yield {"url": url, "vpc_id": vpc, "subnet_ids": subnets, "ami": ami}
        finally:
            server.stop()


@pytest.fixture(scope="module")
def fake_aws() -> Iterator[dict[str, Any]]:
    with moto_account() as account:
        yield account


def write_tfvars(workdir: Path, fake_aws: dict[str, Any], name: str, **overrides: Any) -> str:
    """The variables of deployment `name` in the fake account, as a file in workdir; its name."""
    zip_path = workdir / "gateway.zip"
    shutil.make_archive(str(zip_path.with_suffix("")), "zip", REPO_TF.parent, "gateway")
    tfvars = {"name": name, "aws_endpoint_url": fake_aws["url"], "vpc_id": fake_aws["vpc_id"],
              "subnet_ids": fake_aws["subnet_ids"], "worker_ami_id": fake_aws["ami"], "gateway_zip": str(zip_path),
              "models_yaml": MODELS_YAML, "drain_budget_s": 60, **overrides}
    (workdir / f"{name}.tfvars.json").write_text(json.dumps(tfvars))
    return f"{name}.tfvars.json"


def plan(workdir: Path, fake_aws: dict[str, Any], name: str, **overrides: Any) -> subprocess.CompletedProcess[str]:
    var_file = write_tfvars(workdir, fake_aws, name, **overrides)
    return tf(workdir, "plan", "-input=false", "-lock=false", f"-var-file={var_file}", f"-out={name}.plan",
              check=False)


def planned_values(workdir: Path, fake_aws: dict[str, Any], name: str, **overrides: Any) -> dict[str, dict[str, Any]]:
    proc = plan(workdir, fake_aws, name, **overrides)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    shown = json.loads(tf(workdir, "show", "-json", f"{name}.plan").stdout)
    return {r["address"]: r["values"] for r in shown["planned_values"]["root_module"]["resources"]}


@pytest.fixture(scope="module")
def planned_own_redis(workdir: Path, fake_aws: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """ElastiCache created here: its endpoint (and what embeds it) is known only after apply."""
    return planned_values(workdir, fake_aws, "bgown")


@pytest.fixture(scope="module")
def planned(workdir: Path, fake_aws: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """An existing Redis: every value is known at plan time."""
    return planned_values(workdir, fake_aws, "bgtest", redis_url=REDIS_URL)


def test_formatted_and_valid(workdir):
    assert tf(REPO_TF, "fmt", "-check", "-recursive", check=False).returncode == 0, "run: terraform fmt -recursive"
    tf(workdir, "validate")


def test_redis_never_evicts_and_is_encrypted_and_replicated(planned_own_redis, planned):
    params = planned_own_redis["aws_elasticache_parameter_group.redis[0]"]["parameter"]
    assert {"name": "maxmemory-policy", "value": "noeviction"} in params
    assert "aws_security_group.redis[0]" in planned_own_redis
    assert not any("elasticache" in address for address in planned)  # an existing Redis: none created
    group = planned_own_redis["aws_elasticache_replication_group.redis[0]"]
    assert group["transit_encryption_enabled"] and group["at_rest_encryption_enabled"]
    assert group["num_cache_clusters"] == 2 and group["automatic_failover_enabled"] and group["multi_az_enabled"]
    assert group["engine"] == "redis"


def test_workers_drain_before_their_instance_goes(planned):
    asg = planned["aws_autoscaling_group.workers"]
    (hook,) = asg["initial_lifecycle_hook"]
    assert hook["lifecycle_transition"] == "autoscaling:EC2_INSTANCE_TERMINATING"
    assert hook["heartbeat_timeout"] == 60 + 60 and hook["default_result"] == "CONTINUE"
    assert "GroupInServiceInstances" in asg["enabled_metrics"]
    lt = planned["aws_launch_template.worker"]
    assert lt["metadata_options"][0]["http_tokens"] == "required"
    script = base64.b64decode(lt["user_data"]).decode()
    assert "ExecStart=/opt/batchgate/bin/batchgate worker" in script
    assert "KillSignal=SIGTERM" in script and "TimeoutStopSec=90" in script
    assert "BATCHGATE_DRAIN_BUDGET_S=60" in script and "BATCHGATE_KEY_PREFIX=bgtest" in script
    assert f"BATCHGATE_REDIS_URL={REDIS_URL}" in script
    assert "BATCHGATE_CONFIG=/etc/batchgate/models.yaml" in script and MODELS_YAML in script
    assert "complete-lifecycle-action" in script and "spot/instance-action" in script
    assert "--auto-scaling-group-name 'bgtest-workers'" in script
    syntax = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr


def test_a_worker_whose_bootstrap_fails_stops_so_the_group_replaces_it(planned, tmp_path):
    """An AMI whose python3 is older than 3.11 (Ubuntu 22.04's Deep Learning AMIs: 3.10), or any failing step, left an
    instance InService with no worker (EC2 health checks), which the scaler counted as capacity. The bootstrap now
    stops the instance, saying why; here its first lines run with such a python3 and a `shutdown` that records."""
    script = base64.b64decode(planned["aws_launch_template.worker"]["user_data"]).decode()
    head = script[:script.index("python3 -m venv")]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text("#!/bin/sh\n[ \"$1\" = -V ] && echo 'Python 3.10.12' && exit 0\nexit 1\n")
    (bin_dir / "shutdown").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'shutdown'}\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    ran = subprocess.run(["bash", "-c", head + "echo went on\n"], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert ran.returncode != 0 and "went on" not in ran.stdout, ran
    assert "batchgate needs Python 3.11+; this AMI's python3 is Python 3.10.12" in ran.stderr, ran.stderr
    assert "bootstrap failed" in ran.stderr and (tmp_path / "shutdown").read_text().split() == ["-h", "now"]
    (tmp_path / "shutdown").unlink()
    (bin_dir / "python3").write_text("#!/bin/sh\nexit 0\n")  # a 3.11+: the bootstrap goes on
    ok = subprocess.run(["bash", "-c", head + "echo went on\n"], capture_output=True, text=True, timeout=30,
                        env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert ok.returncode == 0 and ok.stdout == "went on\n" and not (tmp_path / "shutdown").exists(), ok


def test_workers_run_the_batch_runner_keep_the_redis_url_private_and_take_operators_through_ssm(planned):
    script = base64.b64decode(planned["aws_launch_template.worker"]["user_data"]).decode()
    assert "ExecStart=/opt/batchgate/bin/batchgate batches" in script  # the Batch API's batches run somewhere
    assert "batchgate-batches.service" in script.rsplit("systemctl enable", 1)[1]
    assert script.index("install -m 0600 /dev/null /etc/batchgate/env") < script.index("cat > /etc/batchgate/env")
    assert "ln -sf /opt/batchgate/bin/batchgate /usr/local/bin/batchgate" in script
    ssm = planned["aws_iam_role_policy_attachment.worker_ssm"]
    assert ssm["policy_arn"].endswith("/AmazonSSMManagedInstanceCore")


def test_a_public_function_url_is_allowed_to_be_called(planned, workdir, fake_aws):
    """With gateway_url_auth NONE the URL answers only if the function's policy lets anyone call it through the
    URL, and (URLs created since October 2025) invoke it: the API and Terraform add neither (the console does)."""
    url = planned['aws_lambda_permission.gateway_url_public["InvokeFunctionUrl"]']
    assert (url["action"], url["principal"], url["function_url_auth_type"]) == ("lambda:InvokeFunctionUrl", "*", "NONE")
    invoke = planned['aws_lambda_permission.gateway_url_public["InvokeFunction"]']
    assert (invoke["action"], invoke["principal"]) == ("lambda:InvokeFunction", "*")
    signed = planned_values(workdir, fake_aws, "bgiam", redis_url=REDIS_URL, gateway_url_auth="AWS_IAM")
    assert not any(a.startswith("aws_lambda_permission.gateway_url_public") for a in signed)


def test_scaling_on_backlog_per_worker_and_from_zero(planned):
    policy = planned["aws_autoscaling_policy.backlog_per_worker"]["target_tracking_configuration"][0]
    assert policy["target_value"] == 64
    metrics = {m["id"]: m for m in policy["customized_metric_specification"][0]["metrics"]}
    assert metrics["per_worker"]["expression"] == "backlog / IF(workers > 0, workers, 1)"
    backlog = metrics["backlog"]["metric_stat"][0]["metric"][0]
    assert (backlog["namespace"], backlog["metric_name"]) == ("batchgate", "Backlog")
    assert backlog["dimensions"] == [{"name": "Deployment", "value": "bgtest"}]
    alarm = planned["aws_cloudwatch_metric_alarm.backlog_without_workers"]
    assert any(q.get("expression") == "IF(backlog > 0 AND workers == 0, 1, 0)" for q in alarm["metric_query"])
    first = planned["aws_autoscaling_policy.first_worker"]
    assert (first["adjustment_type"], first["scaling_adjustment"]) == ("ExactCapacity", 1)
    scaler = planned["aws_lambda_function.scaler"]
    assert scaler["handler"] == "gateway.scaling_handler.handler"
    assert scaler["environment"][0]["variables"]["BATCHGATE_DEPLOYMENT"] == "bgtest"
    assert planned["aws_cloudwatch_event_rule.scaler"]["schedule_expression"] == "rate(1 minute)"


def test_gateway_lambda_with_auth_and_the_models_inline(planned):
    gw = planned["aws_lambda_function.gateway"]
    assert gw["handler"] == "gateway.lambda_handler.http_handler" and gw["runtime"] == "python3.11"
    env = gw["environment"][0]["variables"]
    assert env["BATCHGATE_AUTH"] == "api_key" and env["BATCHGATE_CONFIG_YAML"] == MODELS_YAML
    from shared.config import Settings

    assert Settings.from_environ(env).auth == "api_key"  # the Lambda's settings really start (was "on": refused)
    assert env["BATCHGATE_KEY_PREFIX"] == "bgtest" and int(env["BATCHGATE_MAX_WAIT_S"]) < gw["timeout"]
    assert env["BATCHGATE_REDIS_URL"] == REDIS_URL
    assert gw["vpc_config"][0]["subnet_ids"]
    assert planned["aws_lambda_function_url.gateway"]["authorization_type"] == "NONE"
    # the handler modules named in the plan exist in the package
    for handler in (gw["handler"], planned["aws_lambda_function.scaler"]["handler"]):
        module = handler.rsplit(".", 1)[0]
        assert (REPO_TF.parent / (module.replace(".", "/") + ".py")).is_file()


@pytest.mark.parametrize(("overrides", "says"), [
    ({"subnet_ids": None}, "at least two subnets"),
    # each of these planned, and the workers it started exited at start-up (systemd restarting them forever)
    ({"drain_budget_s": -5}, "drain_budget_s is a number of seconds"),
    ({"models_yaml": "models: ["}, "models_yaml is YAML"),
    ({"models_yaml": "- name: tiny-llama\n"}, "models_yaml is YAML"),
    ({"redis_url": "http://redis.example.internal:6379"}, "redis_url is a Redis URL"),
    ({"worker_min": 10, "worker_max": 8}, "worker_min is at least 0 and at most worker_max"),
    ({"worker_max": 0}, "worker_max is at least 1"),
    # each of these planned, then failed at apply (ElastiCache's id, Lambda's 4 KB environment) or at every message
    ({"name": "bg--x"}, "with no '--' and no '-' at the end"),
    ({"name": "bgx-"}, "with no '--' and no '-' at the end"),
    ({"models_yaml": "models:\n" + "# a comment that fills the environment\n" * 80}, "models_yaml is at most 3,000"),
    ({"lambda_tenant": "t" * 129}, "lambda_tenant is a tenant name"),
    ({"lambda_tenant": "a\u00a0b"}, "lambda_tenant is a tenant name"),  # a no-break space
])
def test_bad_variables_are_refused_with_a_message(workdir, fake_aws, overrides, says):
    if overrides.get("subnet_ids", 0) is None:
        overrides = {"subnet_ids": fake_aws["subnet_ids"][:1]}
    overrides = dict(overrides)
    proc = plan(workdir, fake_aws, overrides.pop("name", "bgbad"), **{"redis_url": REDIS_URL, **overrides})
    assert proc.returncode != 0 and says in " ".join((proc.stderr + proc.stdout).split()), proc.stderr


def test_an_sqs_queue_feeds_the_sqs_handler_with_per_message_failures(workdir, fake_aws):
    """Without ReportBatchItemFailures one refused message would redeliver its whole batch (issue 17)."""
    values = planned_values(workdir, fake_aws, "bgsqs", redis_url=REDIS_URL,
                            sqs_queue_arn="arn:aws:sqs:us-east-1:123456789012:batchgate-in")
    mapping = values["aws_lambda_event_source_mapping.sqs[0]"]
    assert mapping["function_response_types"] == ["ReportBatchItemFailures"]
    fn = values["aws_lambda_function.sqs[0]"]
    assert fn["handler"] == "gateway.lambda_handler.sqs_handler"
    assert fn["environment"][0]["variables"]["BATCHGATE_AUTH"] == "api_key"
    (statement,) = json.loads(values["aws_iam_role_policy.lambda_sqs[0]"]["policy"])["Statement"]
    assert statement["Resource"] == "arn:aws:sqs:us-east-1:123456789012:batchgate-in"  # this queue, not every one
    assert not any("sqs" in address for address in planned_values(workdir, fake_aws, "bgnosqs", redis_url=REDIS_URL))


def test_a_private_files_bucket_named_to_the_gateway_and_the_workers(planned):
    """The Files and Batch APIs' store (terraform/files.tf): not public, its name in both environments."""
    bucket = planned["aws_s3_bucket.files"]["bucket"]
    assert bucket.startswith("bgtest-files-")
    block = planned["aws_s3_bucket_public_access_block.files"]
    assert all(block[k] for k in ("block_public_acls", "block_public_policy", "ignore_public_acls",
                                  "restrict_public_buckets"))
    (rule,) = planned["aws_s3_bucket_lifecycle_configuration.files"]["rule"]
    assert rule["abort_incomplete_multipart_upload"][0]["days_after_initiation"] == 1
    env = planned["aws_lambda_function.gateway"]["environment"][0]["variables"]
    assert env["BATCHGATE_FILES_S3_BUCKET"] == bucket
    from shared.config import Settings

    assert Settings.from_environ(env).files_s3_bucket == bucket
    script = base64.b64decode(planned["aws_launch_template.worker"]["user_data"]).decode()
    assert f"BATCHGATE_FILES_S3_BUCKET={bucket}" in script and "batchgate[worker,aws]" in script
    for role in ("lambda_files", "worker_files"):
        policy = json.loads(planned[f"aws_iam_role_policy.{role}"]["policy"])
        actions = {a for s in policy["Statement"] for a in ([s["Action"]] if isinstance(s["Action"], str)
                                                             else s["Action"])}
        assert {"s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:ListBucket"} <= actions


def test_a_redis_password_is_not_printed_by_plan(workdir, fake_aws):
    proc = plan(workdir, fake_aws, "bgsecret", redis_url="redis://:s3cretpass@127.0.0.1:6379/0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "s3cretpass" not in proc.stdout + proc.stderr
