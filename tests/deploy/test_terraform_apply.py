"""`terraform apply`, then `terraform destroy`, of the stack against a fake AWS account (moto's server on
127.0.0.1), for an existing Redis (`redis_url`: the real test Redis). Between the two, the scaler Lambda
of the applied stack, given a backlog in Redis, takes the applied workers' Auto Scaling group from 0 up,
and back to 0 once the backlog is gone.

The own-Redis variant is planned only (test_terraform.py): moto does not implement ElastiCache
parameter groups.

What moto does not simulate, and what the scaling test does in its place:
- CloudWatch never evaluates alarms nor runs their actions, Auto Scaling never evaluates a
  target-tracking policy, and moto's metric math only passes a query's values through. The test
  reads the metric the scaler published back from moto, through the metric queries of the *applied*
  alarm and policy (so their namespace, name and dimensions must match what the scaler publishes),
  evaluates their metric-math expressions and the target tracking itself (the proportional rule,
  desired = ceil(capacity * metric / target) within min..max: an approximation of AWS's algorithm,
  which also smooths and holds scale-in back), then does what AWS would: runs the alarm's action (the
  applied policy its ARN names, through moto's ExecutePolicy) or sets the group's desired capacity.
- moto publishes no AWS/AutoScaling metrics: `workers` (GroupInServiceInstances) is the number of the
  group's instances that moto reports InService.
- The instances are fake: nothing boots, the user data does not run, and the termination lifecycle
  hook does not hold an instance in Terminating:Wait.
- The Lambda is not invoked through moto (that needs Docker): its handler runs in a subprocess with
  the applied function's environment variables (plus the CloudWatch endpoint of the fake account).
- A second plan after apply is not checked for "no changes": moto reads some attributes back
  differently (a scaling policy's `enabled`, the launch template's versions), a perpetual diff of
  moto's, not of the configuration.
- moto's account lacks the AWS-managed IAM policies unless told (moto_account() tells it): `apply`
  attaches AWSLambdaVPCAccessExecutionRole.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest
import redis

from shared.config import Settings
from shared.keys import Keys
from tests.deploy.test_terraform import AWS_ENV, REPO_TF, init_workdir, moto_account, tf, write_tfvars

pytestmark = [pytest.mark.redis, pytest.mark.slow]

REPO = REPO_TF.parent
# two models, so that the total (the metric scaling reads) differs from each model's own datapoint
MODELS_YAML = "models:\n  - name: tiny-llama\n    max_running: 32\n  - name: minilm\n"
BACKLOG = {"tiny-llama": 100, "minilm": 50}  # 150: with the default target of 64 per worker, 3 workers (max 4)
TOTAL = sum(BACKLOG.values())
RUN_SCALER = """
import json
from gateway.scaling_handler import handler
print("RESULT " + json.dumps(handler({"source": "aws.events", "detail-type": "Scheduled Event"}, None)))
"""


@dataclass
class Deployment:
    name: str
    workdir: Path
    var_file: str
    outputs: dict[str, Any]
    endpoint: str

    def client(self, service: str) -> Any:
        return boto3.client(service, endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def terraform(self, command: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return tf(self.workdir, command, "-input=false", "-lock=false", f"-var-file={self.var_file}", *args,
                  check=check)

    def state(self) -> list[str]:
        """The resources (not data sources) in the local state: what a destroy has left."""
        path = self.workdir / "terraform.tfstate"
        state = json.loads(path.read_text()) if path.is_file() else {}
        return [f"{r['type']}.{r['name']}" for r in state.get("resources", []) if r["mode"] == "managed"]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Deployment]:
    """The stack applied in a fresh fake account; destroyed afterwards whatever happened (the destroy
    test normally has done it already)."""
    work = init_workdir(tmp_path_factory)
    name = f"bga-{secrets.token_hex(4)}"  # also the Redis key prefix: unique, so every key under it is ours
    with moto_account() as account:
        var_file = write_tfvars(work, account, name, redis_url=redis_url, models_yaml=MODELS_YAML)
        deployed = Deployment(name, work, var_file, {}, account["url"])
        try:
            deployed.terraform("apply", "-auto-approve")
            deployed.outputs = {k: v["value"] for k, v in json.loads(tf(work, "output", "-json").stdout).items()}
            yield deployed
        finally:
            if deployed.state():
                deployed.terraform("destroy", "-auto-approve")


def test_apply_creates_the_stack_in_the_account(deployment: Deployment, redis_url: str) -> None:
    out = deployment.outputs
    assert out["redis_url"] == redis_url and out["key_prefix"] == deployment.name
    asg_name = out["worker_asg_name"]
    autoscaling = deployment.client("autoscaling")
    (group,) = autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[asg_name])["AutoScalingGroups"]
    assert (group["MinSize"], group["DesiredCapacity"], group["MaxSize"]) == (0, 0, 4) and not group["Instances"]
    (hook,) = autoscaling.describe_lifecycle_hooks(AutoScalingGroupName=asg_name)["LifecycleHooks"]
    assert hook["LifecycleTransition"] == "autoscaling:EC2_INSTANCE_TERMINATING" and hook["HeartbeatTimeout"] == 120
    policies = {p["PolicyName"]: p
                for p in autoscaling.describe_policies(AutoScalingGroupName=asg_name)["ScalingPolicies"]}
    first = policies[f"{deployment.name}-first-worker"]
    assert policies[f"{deployment.name}-backlog-per-worker"]["PolicyType"] == "TargetTrackingScaling"
    (alarm,) = deployment.client("cloudwatch").describe_alarms(
        AlarmNames=[f"{deployment.name}-backlog-without-workers"])["MetricAlarms"]
    assert alarm["AlarmActions"] == [first["PolicyARN"]]  # the alarm starts the first worker

    lambdas = deployment.client("lambda")
    scaler = lambdas.get_function_configuration(FunctionName=f"{deployment.name}-scaler")
    assert scaler["Handler"] == "gateway.scaling_handler.handler"
    assert scaler["Environment"]["Variables"]["BATCHGATE_REDIS_URL"] == redis_url
    (target,) = deployment.client("events").list_targets_by_rule(Rule=f"{deployment.name}-scaler")["Targets"]
    assert target["Arn"] == scaler["FunctionArn"]  # run every minute
    gateway = lambdas.get_function_configuration(FunctionName=f"{deployment.name}-gateway")
    assert gateway["Environment"]["Variables"]["BATCHGATE_AUTH"] == "api_key"
    # a role per Lambda: the public gateway cannot publish the scaling metric, the scaler cannot touch the files
    iam = deployment.client("iam")
    roles = {fn["Handler"]: fn["Role"].rsplit("/", 1)[1] for fn in (gateway, scaler)}
    assert len(set(roles.values())) == 2
    inline = {handler: set(iam.list_role_policies(RoleName=role)["PolicyNames"]) for handler, role in roles.items()}
    assert inline == {gateway["Handler"]: {f"{deployment.name}-files"},
                      scaler["Handler"]: {f"{deployment.name}-metrics"}}
    for role in roles.values():
        attached = iam.list_attached_role_policies(RoleName=role)["AttachedPolicies"]
        assert [p["PolicyName"] for p in attached] == ["AWSLambdaVPCAccessExecutionRole"]
    assert deployment.client("s3").head_bucket(Bucket=out["files_bucket"])["ResponseMetadata"]["HTTPStatusCode"] == 200


# --- the scaler against the applied account ---------------------------------------------------


def metric_math(expression: str, **values: float) -> float:
    """A CloudWatch metric-math expression of the applied stack (IF, AND/OR, comparisons, arithmetic)."""
    assert re.fullmatch(r"[A-Za-z_][\w\s().,<>=!/*+-]*", expression), expression
    python = re.sub(r"\bOR\b", "or", re.sub(r"\bAND\b", "and", expression))
    return float(eval(python, {"__builtins__": {}, "IF": lambda cond, yes, no: yes if cond else no}, values))


def next_period() -> dt.datetime:
    """Wait for the next whole second and return it: every datapoint published before is older. In
    production the scaler runs once a minute, so each evaluation period holds one datapoint; here the
    runs are seconds apart, and each is read back from its own window."""
    now = time.time()
    start = math.floor(now) + 1
    time.sleep(start - now)
    return dt.datetime.fromtimestamp(start, dt.UTC)


def read_metric(cloudwatch: Any, query: dict[str, Any], since: dt.datetime) -> float | None:
    """The value of a MetricStat query over the period that starts at `since`; None: no data."""
    stat = {**query["MetricStat"], "Period": query["MetricStat"].get("Period", 60)}
    # moto's GetMetricData matches the dimensions exactly (as CloudWatch does) but not the namespace
    # when there are dimensions; ListMetrics checks the namespace: the metric must be listed there.
    metric = stat["Metric"]
    listed = cloudwatch.list_metrics(Namespace=metric["Namespace"], MetricName=metric["MetricName"],
                                     Dimensions=metric["Dimensions"])["Metrics"]
    if not any(sorted(m["Dimensions"], key=str) == sorted(metric["Dimensions"], key=str) for m in listed):
        return None
    period = dt.timedelta(seconds=stat["Period"])
    (result,) = cloudwatch.get_metric_data(MetricDataQueries=[{"Id": query["Id"], "MetricStat": stat}],
                                           StartTime=since, EndTime=since + period)["MetricDataResults"]
    assert len(result["Values"]) <= 1, result
    return result["Values"][0] if result["Values"] else None


def dimensions(query: dict[str, Any]) -> dict[str, str]:
    metric = query["MetricStat"]["Metric"]
    return {d["Name"]: d["Value"] for d in metric["Dimensions"]} | {"": f"{metric['Namespace']}/{metric['MetricName']}"}


@dataclass
class Autoscaler:
    """AWS's side of the applied scaling, which moto does not run: the alarm and the target tracking."""

    deployment: Deployment
    asg_name: str

    def group(self) -> dict[str, Any]:
        (group,) = self.deployment.client("autoscaling").describe_auto_scaling_groups(
            AutoScalingGroupNames=[self.asg_name])["AutoScalingGroups"]
        return group

    def in_service(self) -> int:  # what GroupInServiceInstances counts (moto publishes no such metric)
        return sum(1 for i in self.group()["Instances"] if i["LifecycleState"] == "InService")

    def queries(self, queries: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
        """The backlog's MetricStat query and the expression; `workers` checked to be this group's."""
        by_id = {q["Id"]: q for q in queries}
        assert dimensions(by_id["workers"]) == {"AutoScalingGroupName": self.asg_name,
                                                "": "AWS/AutoScaling/GroupInServiceInstances"}
        (expression,) = [q["Expression"] for q in queries if q.get("ReturnData", True)]
        return by_id["backlog"], expression

    def evaluate(self, since: dt.datetime) -> dict[str, Any]:
        """One evaluation of the alarm and of the target-tracking policy, on the datapoints published
        since `since`, and what AWS would then do to the group."""
        autoscaling = self.deployment.client("autoscaling")
        cloudwatch = self.deployment.client("cloudwatch")
        workers = self.in_service()
        seen: dict[str, Any] = {"workers": workers}

        (alarm,) = cloudwatch.describe_alarms(
            AlarmNames=[f"{self.deployment.name}-backlog-without-workers"])["MetricAlarms"]
        backlog_query, expression = self.queries(alarm["Metrics"])
        backlog = read_metric(cloudwatch, backlog_query, since)
        seen["alarm_backlog"] = backlog
        assert alarm["ComparisonOperator"] == "GreaterThanOrEqualToThreshold"
        assert alarm["TreatMissingData"] == "notBreaching"
        firing = backlog is not None and metric_math(expression, backlog=backlog, workers=workers) >= alarm["Threshold"]
        seen["alarm"] = firing
        if firing:  # the alarm's actions: the applied policies their ARNs name
            policies = autoscaling.describe_policies(AutoScalingGroupName=self.asg_name)["ScalingPolicies"]
            for arn in alarm["AlarmActions"]:
                (policy,) = [p for p in policies if p["PolicyARN"] == arn]
                autoscaling.execute_policy(AutoScalingGroupName=self.asg_name, PolicyName=policy["PolicyName"],
                                           HonorCooldown=False)

        (policy,) = autoscaling.describe_policies(AutoScalingGroupName=self.asg_name,
                                                  PolicyTypes=["TargetTrackingScaling"])["ScalingPolicies"]
        tracking = policy["TargetTrackingConfiguration"]
        backlog_query, expression = self.queries(tracking["CustomizedMetricSpecification"]["Metrics"])
        backlog = read_metric(cloudwatch, backlog_query, since)
        seen["tracking_backlog"] = backlog
        # Proportional to the capacity, so it cannot start from 0 in service: that is the alarm's job.
        if backlog is not None and workers > 0:
            per_worker = metric_math(expression, backlog=backlog, workers=workers)
            group = self.group()
            wanted = math.ceil(workers * per_worker / tracking["TargetValue"])
            wanted = min(max(wanted, group["MinSize"]), group["MaxSize"])
            seen["tracking"] = wanted
            if wanted != group["DesiredCapacity"]:
                autoscaling.set_desired_capacity(AutoScalingGroupName=self.asg_name, DesiredCapacity=wanted,
                                                 HonorCooldown=False)
        group = self.group()
        assert len(group["Instances"]) == group["DesiredCapacity"]  # moto launches and terminates at once
        return seen


def run_scaler(env: dict[str, str]) -> dict[str, Any]:
    """The scaler Lambda's handler, in a fresh process (a cold Lambda container) with `env` alone."""
    proc = subprocess.run([sys.executable, "-c", RUN_SCALER], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


def test_the_applied_scaler_takes_the_applied_group_from_zero_and_back(deployment: Deployment,
                                                                       redis_url: str) -> None:
    asg_name = deployment.outputs["worker_asg_name"]
    scaler = deployment.client("lambda").get_function_configuration(FunctionName=f"{deployment.name}-scaler")
    lambda_env = scaler["Environment"]["Variables"]
    env = {"PATH": os.environ.get("PATH", ""), **AWS_ENV, "AWS_REGION": "us-east-1", **lambda_env,
           "BATCHGATE_CLOUDWATCH_ENDPOINT": deployment.endpoint}  # a real Lambda uses CloudWatch's own
    settings = Settings.from_environ(lambda_env)  # the models the Lambda knows (BATCHGATE_CONFIG_YAML)
    assert sorted(m.name for m in settings.models) == sorted(BACKLOG)
    keys = Keys(lambda_env["BATCHGATE_KEY_PREFIX"])
    streams = {m.name: keys.lane_streams(m.name, m.lane_names) for m in settings.models}
    autoscaler = Autoscaler(deployment, asg_name)
    assert autoscaler.group()["DesiredCapacity"] == 0

    client = redis.Redis.from_url(redis_url)
    ours = [s for model_streams in streams.values() for s in model_streams]
    assert not client.exists(*ours)  # a prefix of this test's own: everything under it is ours
    added: dict[str, list[bytes]] = {s: [] for s in ours}
    try:
        for model, n in BACKLOG.items():  # the backlog, spread over each model's lanes
            for i in range(n):
                stream = streams[model][i % len(streams[model])]
                added[stream].append(client.xadd(stream, {"m": b"x"}))

        # minute 1: a backlog and no worker. The alarm starts one (target tracking cannot, from 0).
        since = next_period()
        assert run_scaler(env) == {"deployment": deployment.name, "backlog": BACKLOG, "total": TOTAL, "upkeep": 0}
        seen = autoscaler.evaluate(since)
        assert seen["alarm_backlog"] == seen["tracking_backlog"] == TOTAL and seen["workers"] == 0
        assert seen["alarm"] and autoscaler.group()["DesiredCapacity"] == 1 and autoscaler.in_service() == 1

        # minute 2: the same backlog over one worker: target tracking sizes the group.
        since = next_period()
        assert run_scaler(env)["total"] == TOTAL
        seen = autoscaler.evaluate(since)
        assert not seen["alarm"] and seen["tracking"] == math.ceil(TOTAL / 64) == 3
        assert autoscaler.group()["DesiredCapacity"] == 3 and autoscaler.in_service() == 3

        # the workers finish everything (they delete what they acknowledge)
        for stream, ids in added.items():
            client.xdel(stream, *ids)

        # minute 3: no backlog: back to 0
        since = next_period()
        assert run_scaler(env) == {"deployment": deployment.name, "backlog": dict.fromkeys(BACKLOG, 0), "total": 0,
                                   "upkeep": 0}
        seen = autoscaler.evaluate(since)
        assert seen["alarm_backlog"] == seen["tracking_backlog"] == 0 and seen["workers"] == 3
        assert not seen["alarm"] and seen["tracking"] == 0
        assert autoscaler.group()["DesiredCapacity"] == 0 and autoscaler.in_service() == 0
    finally:
        client.delete(*ours)  # the streams this test created
        client.close()


def test_destroy_removes_everything(deployment: Deployment) -> None:
    deployment.terraform("destroy", "-auto-approve")
    assert deployment.state() == []
    name = deployment.name
    assert not deployment.client("autoscaling").describe_auto_scaling_groups(
        AutoScalingGroupNames=[deployment.outputs["worker_asg_name"]])["AutoScalingGroups"]
    assert not [f for f in deployment.client("lambda").list_functions()["Functions"]
                if f["FunctionName"].startswith(f"{name}-")]
    assert not deployment.client("cloudwatch").describe_alarms(AlarmNamePrefix=name)["MetricAlarms"]
    assert not deployment.client("events").list_rules(NamePrefix=name)["Rules"]
    assert not [r for r in deployment.client("iam").list_roles()["Roles"] if r["RoleName"].startswith(f"{name}-")]
    assert deployment.outputs["files_bucket"] not in {
        b["Name"] for b in deployment.client("s3").list_buckets()["Buckets"]}
    ec2 = deployment.client("ec2")
    groups = ec2.describe_security_groups(Filters=[{"Name": "group-name", "Values": [f"{name}-*"]}])
    assert not groups["SecurityGroups"]
    assert not ec2.describe_launch_templates(
        Filters=[{"Name": "launch-template-name", "Values": [f"{name}-worker-*"]}])["LaunchTemplates"]
