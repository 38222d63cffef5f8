"""examples/k8s/ against the Kubernetes API schema, without a cluster.

Every document of every manifest is validated into the official
``kubernetes`` client's model class for its apiVersion and kind (``V1`` +
kind), strictly: the models forbid unknown fields and check types and
required fields (``model_validate``; the client's lenient ``from_dict``
would drop an unknown field, which the negative tests show).  Then what
ties the manifests together: the Service selects the lighthouse's pods and
targets its port, every replica group's Job points at that Service, has
its own REPLICA_GROUP_ID and restarts, and every environment variable set
for stepguard is one that ``stepguard.config`` knows.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pydantic
import pytest
import yaml

kubernetes = pytest.importorskip(
    "kubernetes", reason="the kubernetes client is in the test extra (scripts/bootstrap)")
from kubernetes import client as k8s  # noqa: E402

from stepguard import config  # noqa: E402

K8S_DIR = Path(__file__).resolve().parents[2] / "examples" / "k8s"


def model_class(doc: dict):
    """The client's model class for a document's apiVersion and kind."""
    version = str(doc.get("apiVersion", "")).rsplit("/", 1)[-1]
    name = version[:1].upper() + version[1:] + str(doc.get("kind", ""))
    cls = getattr(k8s, name, None)
    if cls is None or not issubclass(cls, pydantic.BaseModel):
        raise ValueError(f"no Kubernetes model {name} for apiVersion "
                         f"{doc.get('apiVersion')!r} kind {doc.get('kind')!r}")
    return cls


def validate(doc: dict):
    """The document as its model, or pydantic.ValidationError / ValueError."""
    return model_class(doc).model_validate(doc)


def documents() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(K8S_DIR.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                out.append((path.name, doc))
    return out


def by_kind(kind: str) -> list:
    return [validate(d) for _, d in documents() if d["kind"] == kind]


def env_of(container) -> dict:
    return {e.name: e for e in container.env or []}


def test_every_manifest_is_a_valid_kubernetes_object():
    docs = documents()
    kinds = sorted(d["kind"] for _, d in docs)
    assert kinds == ["Deployment", "Job", "Job", "Service"], kinds
    for name, doc in docs:
        obj = validate(doc)
        assert obj.metadata.name, name
        # the model holds everything the file says: nothing was dropped
        assert obj.model_dump(by_alias=True, exclude_none=True, mode="json") == doc, name


def test_the_lighthouse_service_reaches_the_lighthouse():
    (dep,), (svc,) = by_kind("Deployment"), by_kind("Service")
    labels = dep.spec.template.metadata.labels
    assert dep.spec.selector.match_labels.items() <= labels.items()
    assert svc.spec.selector.items() <= labels.items()
    (c,) = dep.spec.template.spec.containers
    ports = {p.name: p.container_port for p in c.ports}
    (sp,) = svc.spec.ports
    assert sp.target_port in ports or sp.target_port in ports.values()
    bind = [a for a in c.args if a.startswith("--bind=")]
    assert bind and bind[0].endswith(f":{ports['lighthouse']}")
    assert dep.spec.strategy.type == "Recreate"  # one deciding lighthouse
    assert c.readiness_probe.http_get.path == "/status"


def test_each_replica_group_is_a_restarting_job_that_finds_the_lighthouse():
    (svc,) = by_kind("Service")
    want = f"http://{svc.metadata.name}:{svc.spec.ports[0].port}"
    jobs = by_kind("Job")
    groups = []
    for job in jobs:
        spec = job.spec.template.spec
        assert spec.restart_policy in ("Never", "OnFailure")
        assert job.spec.backoff_limit >= 100, job.metadata.name
        (c,) = spec.containers
        env = env_of(c)
        assert env["TORCHFT_LIGHTHOUSE"].value == want
        groups.append(int(env["REPLICA_GROUP_ID"].value))
        assert env["STEPGUARD_AUTH_TOKEN"].value_from.secret_key_ref.name == "stepguard-auth"
        assert env["STEPGUARD_ADVERTISE_HOST"].value_from.field_ref.field_path == "status.podIP"
    assert sorted(groups) == list(range(len(jobs)))
    assert len({j.metadata.name for j in jobs}) == len(jobs)


def test_every_stepguard_variable_is_one_stepguard_reads():
    for name, doc in documents():
        obj = validate(doc)
        tmpl = getattr(obj.spec, "template", None)
        if tmpl is None:
            continue
        for c in tmpl.spec.containers:
            for var in env_of(c):
                config.lookup(var)  # KeyError: a name stepguard does not read


# ---- the check can fail ------------------------------------------------------


def _job() -> dict:
    return copy.deepcopy(next(d for _, d in documents() if d["kind"] == "Job"))


def test_a_misspelled_field_fails():
    doc = _job()
    c = doc["spec"]["template"]["spec"]["containers"][0]
    c["imagePullPolicyy"] = "IfNotPresent"
    with pytest.raises(pydantic.ValidationError, match="imagePullPolicyy"):
        validate(doc)
    # the client's lenient path would have taken it silently
    assert k8s.V1Job.from_dict(doc) is not None
    doc = _job()
    doc["spec"]["template"]["spec"]["restartPolicyy"] = doc["spec"]["template"][
        "spec"].pop("restartPolicy")
    with pytest.raises(pydantic.ValidationError, match="restartPolicyy"):
        validate(doc)


def test_a_wrong_type_a_missing_field_and_an_unknown_kind_fail():
    doc = _job()
    doc["spec"]["backoffLimit"] = "many"
    with pytest.raises(pydantic.ValidationError, match="backoffLimit"):
        validate(doc)
    doc = _job()
    del doc["spec"]["template"]["spec"]["containers"][0]["name"]
    with pytest.raises(pydantic.ValidationError, match="name"):
        validate(doc)
    doc = _job()
    doc["kind"] = "Jobb"
    with pytest.raises(ValueError, match="no Kubernetes model V1Jobb"):
        validate(doc)


def test_a_misspelled_variable_fails():
    with pytest.raises(KeyError):
        config.lookup("TORCHFT_LIGHTHOUS")


def test_the_more_groups_command_of_the_docs_makes_a_valid_job():
    # docs/kubernetes.md, "More groups": awk and sed, then kubectl apply
    src = (K8S_DIR / "replica-groups.yaml").read_text()
    doc = [d for d in src.split("---\n")][1]  # awk's RS="---\n", record 2
    g = 2
    doc = doc.replace("stepguard-group-1", f"stepguard-group-{g}", 1)
    doc = doc.replace('"1"', f'"{g}"')
    job = validate(yaml.safe_load(doc))
    assert job.metadata.name == "stepguard-group-2"
    (c,) = job.spec.template.spec.containers
    assert env_of(c)["REPLICA_GROUP_ID"].value == "2"
    assert job.spec.template.metadata.labels["stepguard/replica-group"] == "2"
