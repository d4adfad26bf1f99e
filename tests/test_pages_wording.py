"""The pages' words: counts agree with their nouns (rendered from the real templates), and a
slice names the GPU type it holds."""

from __future__ import annotations

import pytest

from broker.core.fairshare import ProjectTree
from broker.core.model import Account, Policy
from broker.service.pages import page_settings
from broker.service.pages.views import Cluster, node_rows, slice_row
from broker.store.access import Principal
from broker.units import count, duration_text, share_used


@pytest.mark.parametrize(("number", "text"), [(0, "0 nodes"), (1, "1 node"), (2, "2 nodes")])
def test_a_count_is_singular_for_one_only(number, text):
    assert count(number, "node") == text


def test_the_cluster_caption_counts_its_nodes():
    templates = page_settings("/services/broker/")["pages_templates"]
    node = {"name": "n1", "gpu_type": "a100", "held": 0, "cells": [], "state": "ready"}
    html = templates.get_template("_cluster.html").render(data={"nodes": [node]})
    assert "<caption>1 node</caption>" in html


def test_a_slice_of_any_type_shows_the_type_it_was_granted_as_lab_does():
    nodes = [{"name": "n1", "gpu_type": "h100", "gpu_count": 8, "gpus_held": 1, "state": "ready"}]
    cluster = Cluster(nodes, {}, [], Policy())
    granted = {
        "id": 7, "state": "granted", "project": "vision", "kind": "interactive", "gpus": 1,
        "gpu_type": None, "placements": [{"node": "n1", "gpu_indices": [3]}],
        "protected_until": None, "charged_gpu_seconds": 0.0,
    }  # fmt: skip
    assert slice_row(granted, cluster, 0.0)["gpu_type"] == "h100"
    waiting = {**granted, "state": "pending", "placements": []}
    assert slice_row(waiting, cluster, 0.0)["gpu_type"] == "any"


def test_a_gpu_whose_holder_stopped_heartbeating_reads_lapsed_until_it_ends():
    nodes = [{"name": "n1", "gpu_type": "h100", "gpu_count": 2, "gpus_held": 2, "state": "ready"}]
    held = {
        "state": "granted", "project": "vision", "user": "alice", "kind": "interactive",
        "placements": [{"node": "n1", "gpu_indices": [0]}], "protected_until": 500.0,
        "lease_expires_at": 100.0,
    }  # fmt: skip
    other = {**held, "placements": [{"node": "n1", "gpu_indices": [1]}], "lease_expires_at": None}
    cluster = Cluster(nodes, {}, [held, other], Policy())
    viewer = Principal("alice")
    before = node_rows(cluster, viewer, 99.0)[0]["cells"]
    assert [c["status"] for c in before] == ["protected", "protected"]
    after = node_rows(cluster, viewer, 100.0)[0]["cells"]
    assert [(c["status"], c["until"]) for c in after] == [("lapsed", None), ("protected", 500.0)]


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(45, "45 s"), (90, "1 min 30 s"), (900, "15 min"), (5400, "1 h 30 min"), (28800, "8 h")],
)
def test_a_limit_reads_as_it_is_never_rounded(seconds, text):
    assert duration_text(seconds) == text


def test_the_fair_share_value_reads_as_a_ratio_of_its_share_not_as_gpu_hours():
    # vision used 300 of 400 GPU-hours with half the cluster entitled; nlp the rest.
    tree = ProjectTree([Account("vision", 1.0), Account("nlp", 1.0)])
    used = tree.share_used({"vision": 300 * 3600.0, "nlp": 100 * 3600.0})
    assert used == pytest.approx({"vision": 1.5, "nlp": 0.5})
    assert share_used(used["vision"]) == "1.50× its share"
    assert share_used(used["nlp"], words=False) == "0.50×"
    assert share_used(None) == "—"
    # nothing used yet: nobody is over, nobody under
    assert tree.share_used({}) == {"vision": 0.0, "nlp": 0.0}
