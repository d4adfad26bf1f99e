"""The Kubernetes spawner's pod: pinned to the granted node, GPU limits of the grant,
labelled with the slice (the pod manifest, without a hub)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from types import SimpleNamespace

import pytest
from kubefake import FakeKube, gpu_node, serving
from kubernetes_asyncio.client import ApiClient, Configuration, CoreV1Api
from kubernetes_asyncio.client.models import (
    V1Container,
    V1ObjectMeta,
    V1Pod,
    V1PodSpec,
    V1ResourceRequirements,
)
from servicefixtures import serving_in_process

from broker.kube.reaper import PodReaper
from spawner.kube import PROJECT_LABEL, SLICE_LABEL, KubeSliceBrokerSpawner
from spawner.mixin import render_options_form
from spawner.notices import describe
from spawner.options import FORM_TEMPLATE


def pod(limits=None, selector=None):
    container = V1Container(
        name="notebook", resources=V1ResourceRequirements(limits=limits, requests=limits)
    )
    return V1Pod(
        metadata=V1ObjectMeta(name="jupyter-alice", labels={"component": "singleuser-server"}),
        spec=V1PodSpec(containers=[container], node_selector=selector),
    )


def sliced(p, node="gpu-3", gpus=(0, 1), project="vision/team a"):
    fake = SimpleNamespace(
        slice={"id": 42, "project": project, "placements": [{"node": node, "gpu_indices": gpus}]},
        node_label="kubernetes.io/hostname",
        set_gpu_requests=True,
    )
    return KubeSliceBrokerSpawner.slice_pod(fake, p)


CASES = [
    ("whole GPUs: pinned, nvidia.com/gpu set", "gpu-3", None, "gpu-3", {"nvidia.com/gpu": "2"}),
    (
        "a MIG part runs on its node with the MIG resource",
        "gpu-3:1g.10gb",
        None,
        "gpu-3",
        {"nvidia.com/mig-1g.10gb": "2"},
    ),
    (
        "a profile's own GPU limit gives way to the grant, memory stays",
        "gpu-3",
        {"nvidia.com/gpu": "4", "memory": "8Gi"},
        "gpu-3",
        {"nvidia.com/gpu": "2", "memory": "8Gi"},
    ),
]


@pytest.mark.parametrize(
    ("node", "limits", "host", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_pod_is_pinned_with_the_granted_gpus(node, limits, host, expected):
    p = sliced(pod(limits, selector={"pool": "gpu"}), node=node)
    assert p.spec.node_selector == {"pool": "gpu", "kubernetes.io/hostname": host}
    resources = p.spec.containers[0].resources
    assert resources.limits == expected
    assert resources.requests == expected
    assert p.metadata.labels[SLICE_LABEL] == "42"
    assert p.metadata.labels[PROJECT_LABEL] == "vision-team-a"
    assert p.metadata.labels["component"] == "singleuser-server"


def test_only_single_node_grants_are_launched():
    fake = SimpleNamespace()
    problem = KubeSliceBrokerSpawner.placement_problem
    assert problem(fake, {"placements": [{"node": "a"}, {"node": "b"}]})
    assert problem(fake, {"placements": [{"node": "a", "gpu_indices": [0]}]}) is None


# ---- the real KubeSpawner against the API fake, with a real broker -------------------


@contextlib.asynccontextmanager
async def kube_session(tmp_path, monkeypatch, kube: FakeKube, lease: float = 60.0):
    """A broker in process, the API fake, and a spawner factory wired to both."""
    from kubernetes_asyncio.config import kube_config
    from kubespawner import clients

    kube.add_node(gpu_node("n0", 4))
    kube.add_node(gpu_node("n1", 4))
    async with (
        serving(kube) as url,
        serving_in_process(f"sqlite:///{tmp_path}/b.sqlite", lease=lease) as api,
    ):
        config = tmp_path / "kubeconfig"
        config.write_text(KUBECONFIG.format(url=url))
        monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(config))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        clients.load_config.cache_clear()
        agent = api.token("hub", agent=True)
        made: list[KubeSliceBrokerSpawner] = []

        def make(name="alice", traits=None, **options):
            user = SimpleNamespace(name=name, id=len(made) + 1, url=f"/user/{name}/", groups=[])
            spawner = KubeSliceBrokerSpawner(
                **{"events_enabled": False, **(traits or {})},
                _mock=True,
                user=user,
                broker_url=f"http://127.0.0.1:{api.port}/",
                broker_token=agent,
                namespace="jhub",
                heartbeat_interval=5.0,
                user_options={"project": "vision", "gpus": "2", "protected": "15m", **options},
            )
            made.append(spawner)
            return spawner

        try:
            yield api, make
        finally:
            for spawner in made:
                spawner._cancel_watch()
                if spawner._broker is not None:
                    spawner._broker.close()
            for reflector in list(KubeSliceBrokerSpawner.reflectors.values()):
                await reflector.stop()
            KubeSliceBrokerSpawner.reflectors.clear()


KUBECONFIG = """\
apiVersion: v1
kind: Config
clusters: [{{name: fake, cluster: {{server: "{url}"}}}}]
users: [{{name: fake, user: {{token: fake}}}}]
contexts: [{{name: fake, context: {{cluster: fake, user: fake}}}}]
current-context: fake
"""


async def _until(predicate, timeout=10.0):
    """Wait for the reflector (a watch of its own) to see a change."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


async def test_pod_runs_on_the_granted_node_and_stop_releases(tmp_path, monkeypatch):
    kube = FakeKube()
    async with kube_session(tmp_path, monkeypatch, kube) as (api, make):
        spawner = make()
        await spawner.start()
        (pod,) = kube.pods("jhub")
        node = spawner.slice["placements"][0]["node"]
        assert pod["spec"]["nodeSelector"]["kubernetes.io/hostname"] == node
        limits = pod["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == "2"
        assert pod["metadata"]["labels"][SLICE_LABEL] == str(spawner.slice_id)
        assert pod["metadata"]["labels"][PROJECT_LABEL] == "vision"
        assert await spawner.poll() is None
        slice_id = spawner.slice_id
        await spawner.stop()
        assert kube.pods("jhub") == []
        final = api.broker.get_slice(slice_id)
        assert (final["state"], final["end_reason"]) == ("ended", "released")


async def test_a_pod_deleted_by_hand_releases_its_slice_within_one_lease(tmp_path, monkeypatch):
    kube = FakeKube()
    async with kube_session(tmp_path, monkeypatch, kube, lease=60.0) as (api, make):
        spawner = make()
        await spawner.start()
        slice_id = spawner.slice_id
        began = time.time()
        kube.delete("pods", spawner.pod_name, "jhub")  # kubectl delete pod
        key = f"jhub/{spawner.pod_name}"
        await _until(lambda: key not in spawner.pod_reflector.pods)
        assert await spawner.poll() is not None  # the hub's next poll
        final = api.broker.get_slice(slice_id)
        assert (final["state"], final["end_reason"]) == ("ended", "released")
        assert final["ended_at"] - began < api.broker.lease


async def test_faults_leave_no_pod_and_no_slice_behind(tmp_path, monkeypatch):
    kube = FakeKube()
    async with kube_session(tmp_path, monkeypatch, kube) as (api, make):
        # A server error on create fails the spawn: the slice is withdrawn, no pod.
        spawner = make()
        kube.fail("POST", "/pods", 500)
        with pytest.raises(Exception, match="500"):
            await spawner.start()
        assert kube.pods("jhub") == []
        assert api.broker.list_slices(state="live") == []
        # A pod of the same name left behind (a hub crash): create answers 409, KubeSpawner
        # deletes the stale pod and creates it again; one pod, with the new slice.
        stale = {"metadata": {"name": spawner.pod_name, "labels": {}}, "spec": {"containers": []}}
        kube.create("pods", stale, "jhub")
        await spawner.start()
        (pod,) = kube.pods("jhub")
        assert pod["metadata"]["labels"][SLICE_LABEL] == str(spawner.slice_id)
        assert ("POST", "/api/v1/namespaces/jhub/pods") in kube.requests
        held = spawner.slice_id
        # A dropped watch: the reflector resumes and still sees the pod go on stop.
        kube.drop_watches()
        await spawner.stop()
        assert kube.pods("jhub") == []
        assert api.broker.get_slice(held)["state"] == "ended"
        assert api.broker.list_slices(state="live") == []


async def test_a_slice_that_ends_stops_its_pod_and_stale_pods_are_reaped(tmp_path, monkeypatch):
    kube = FakeKube()
    async with kube_session(tmp_path, monkeypatch, kube) as (api, make):
        spawner = make()
        await spawner.start()
        slice_id = spawner.slice_id
        node = spawner.slice["placements"][0]["node"]
        kube.patch("pods", spawner.pod_name, {"metadata": {"labels": {"keep": "1"}}}, "jhub")
        # The node goes down: the broker ends the slice at once; the mixin stops the pod.
        api.broker.set_node_state(node, "down")
        await api.runner.run_pass()
        await _until(lambda: not kube.pods("jhub"))
        assert api.broker.get_slice(slice_id)["end_reason"] == "node_down"

        # A pod whose slice ended while nobody watched it (hub state lost): reaped.
        orphan = {
            "metadata": {"name": "jupyter-old", "labels": {SLICE_LABEL: str(slice_id)}},
            "spec": {"containers": [{"name": "notebook"}]},
        }
        kube.create("pods", orphan, "jhub")
        kube.create("pods", {**orphan, "metadata": {"name": "other"}}, "jhub")  # not ours

        async def live():
            return {s["id"] for s in api.broker.list_slices(state="live")}

        client = ApiClient(Configuration(host=spawner.api.api_client.configuration.host))
        async with client:
            reaper = PodReaper(CoreV1Api(client), "jhub", live, min_age=0)
            kube.fail("DELETE", "/pods/jupyter-old", 500)
            assert await reaper.reap_once() == []  # retried next round
            assert await reaper.reap_once() == ["jupyter-old"]
        assert [p["metadata"]["name"] for p in kube.pods("jhub")] == ["other"]


async def test_a_preempted_pod_runs_until_the_grace_period_ends_then_goes_with_a_notice(
    tmp_path, monkeypatch
):
    kube = FakeKube()
    deleted_at: dict[str, float] = {}
    delete = kube.delete

    def recording_delete(resource, name, namespace=""):
        deleted_at.setdefault(name, time.time())
        return delete(resource, name, namespace)

    monkeypatch.setattr(kube, "delete", recording_delete)
    async with kube_session(tmp_path, monkeypatch, kube) as (api, make):
        # Protected for 1 s, then preempted by a drain with the broker's grace of 2 s.
        spawner = make(
            traits={"protected_choices": ["1s"], "protected_default": "1s"}, protected="1s"
        )
        spawner.orm_spawner = SimpleNamespace(name="", state=None, user_options=None, server=None)
        stopped = []  # the hub hears of the stop through its poll callbacks
        spawner.add_poll_callback(lambda: stopped.append(True))
        await spawner.start()
        slice_id, node = spawner.slice_id, spawner.slice["placements"][0]["node"]
        drain = await api.call("POST", f"/nodes/{node}/drain", token=api.admin_token)
        assert drain.status == 200, drain.text

        await _until(lambda: spawner.notice is not None)
        notice = spawner.notice
        assert (notice["state"], notice["reason"]) == ("preempting", "drain")
        deadline = notice["at"]
        assert deadline == api.broker.get_slice(slice_id)["preempt_deadline"]
        assert spawner.orm_spawner.state["slicebroker"]["notice"]["state"] == "preempting"
        assert "It stops at" in describe(notice)["text"]
        assert [p["metadata"]["name"] for p in kube.pods("jhub")] == [spawner.pod_name]

        await _until(lambda: stopped, timeout=20)
        assert kube.pods("jhub") == []
        assert deleted_at[spawner.pod_name] >= deadline  # not a moment before the grace ended
        final = api.broker.get_slice(slice_id)
        assert (final["state"], final["end_reason"], final["preempt_reason"]) == (
            "ended",
            "preempted",
            "drain",
        )
        notice = spawner.notice
        assert (notice["state"], notice["end_reason"], notice["reason"]) == (
            "ended",
            "preempted",
            "drain",
        )
        assert spawner.orm_spawner.state["slicebroker"]["notice"] == notice
        told = describe(notice)
        assert told["title"] == "Your GPU session was preempted"
        assert "its node is being drained for maintenance" in told["text"]
        assert await spawner.poll() is not None
        assert api.broker.list_slices(state="live") == []


PROFILES = [
    {"display_name": "Small", "slug": "small", "default": True},
    {
        "display_name": "Big GPU box",
        "slug": "big",
        "kubespawner_override": {
            "image": "example.org/pytorch:1",
            "extra_resource_limits": {"nvidia.com/gpu": "8"},
        },
    },
]


async def test_profile_list_keeps_working_and_the_grant_wins(tmp_path, monkeypatch, caplog):
    kube = FakeKube()
    async with kube_session(tmp_path, monkeypatch, kube) as (_, make):
        spawner = make(traits={"profile_list": PROFILES}, profile="big")
        form = await spawner.get_options_form()
        assert form.index('value="big"') < form.index('name="project"')  # profiles first
        submitted = {"profile": ["big"], "project": ["vision"], "gpus": ["2"], "x": ["y"]}
        options = spawner.run_options_from_form(submitted)
        assert options == {"profile": "big", "project": "vision", "gpus": "2"}
        # KubeSpawner read only the fields that are not the slice's.
        assert "Ignoring unrecognized form data in spawn request: x\n" in caplog.text
        assert spawner.options_from_query(submitted) == options
        await spawner.start()
        (pod,) = kube.pods("jhub")
        container = pod["spec"]["containers"][0]
        assert container["image"] == "example.org/pytorch:1"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
        await spawner.stop()
        assert kube.pods("jhub") == []


async def test_the_slice_form_comes_from_the_admins_template_after_any_form_of_their_own(
    tmp_path, monkeypatch
):
    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / FORM_TEMPLATE).write_text(
        '<p id="ours">{% for option in project_options %}{{ option.value }} {% endfor %}</p>'
    )
    kube = FakeKube()
    async with kube_session(tmp_path, monkeypatch, kube) as (_, make):
        spawner = make(traits={"options_form_template_paths": [str(templates)]})
        assert spawner.options_form is render_options_form  # KubeSpawner offers no form
        assert (await spawner.get_options_form()).strip() == '<p id="ours">vision </p>'
        options = spawner.run_options_from_form({"project": ["vision"], "x": ["y"]})
        assert options == {"project": "vision"}  # KubeSpawner's own reading drops "x"

        # An admin's own form: shown first, its fields read by the admin's options_from_form.
        own = make(traits={"options_form": '<p id="own"></p>', "options_from_form": "simple"})
        form = await own.get_options_form()
        assert form.startswith('<p id="own"></p>\n') and 'id="sb-project"' in form
        options = own.run_options_from_form({"project": ["vision"], "x": ["y"]})
        assert options == {"x": "y", "project": "vision"}


async def test_pod_events_follow_the_grant_on_the_progress_stream(tmp_path, monkeypatch):
    kube = FakeKube(run_pods=False)  # the pod waits to be scheduled and its image pulled
    async with kube_session(tmp_path, monkeypatch, kube) as (_, make):
        spawner = make(traits={"events_enabled": True})
        spawner._spawn_pending = True  # as the hub sets it while the spawn runs
        seen: list[dict] = []

        async def read():
            async for event in spawner.progress():
                seen.append(event)

        reader = asyncio.ensure_future(read())
        start = asyncio.ensure_future(spawner.start())
        await _until(lambda: kube.pods("jhub"))
        name, node = spawner.pod_name, spawner.slice["placements"][0]["node"]
        kube.pod_event(name, "jhub", "Scheduled", f"Successfully assigned jhub/{name} to {node}")
        kube.pod_event(name, "jhub", "Pulling", 'Pulling image "quay.io/jupyter/base-notebook"')
        kube.pod_event("jupyter-bob", "jhub", "Pulling", "another user's pod")
        await _until(lambda: any("Pulling image" in e["message"] for e in seen))
        assert not start.done()  # the events came while the pod was still starting
        kube.start_pod(name, "jhub")
        await asyncio.wait_for(start, 30)
        spawner._spawn_pending = False
        await asyncio.wait_for(reader, 10)

        messages = [e["message"] for e in seen]
        granted = next(i for i, m in enumerate(messages) if m.startswith("Granted 2 GPUs"))
        pod_events = messages[granted + 1 :]
        assert all("[Normal]" in m for m in pod_events[:2])
        assert f"Successfully assigned jhub/{name} to {node}" in pod_events[0]
        assert 'Pulling image "quay.io/jupyter/base-notebook"' in pod_events[1]
        assert not any("another user's pod" in m for m in messages)
        bar = [e["progress"] for e in seen if "progress" in e]
        assert bar == sorted(bar) and bar[-1] < 100  # the bar never goes back
        assert all(e["progress"] > 60 for e in seen[granted + 1 :] if "progress" in e)
        await spawner.stop()
