"""The pages' words: counts agree with their nouns (rendered from the real templates)."""

from __future__ import annotations

import pytest

from broker.service.pages import page_settings


def _caption(count: int) -> str:
    templates = page_settings("/services/broker/")["pages_templates"]
    node = {
        "name": "n1",
        "gpu_type": "a100",
        "held": 0,
        "cells": [],
        "state": "ready",
        "in_config": True,
    }
    html = templates.get_template("_cluster.html").render(data={"nodes": [node] * count})
    return html.split("<caption>", 1)[1].split("</caption>", 1)[0]


@pytest.mark.parametrize(("count", "caption"), [(0, "0 nodes"), (1, "1 node"), (2, "2 nodes")])
def test_the_cluster_caption_counts_nodes_in_the_singular_for_one(count, caption):
    assert _caption(count) == caption
