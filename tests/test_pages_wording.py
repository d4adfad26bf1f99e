"""The pages' words: counts agree with their nouns (rendered from the real templates)."""

from __future__ import annotations

import pytest

from broker.service.pages import page_settings
from broker.units import count


@pytest.mark.parametrize(("number", "text"), [(0, "0 nodes"), (1, "1 node"), (2, "2 nodes")])
def test_a_count_is_singular_for_one_only(number, text):
    assert count(number, "node") == text


def test_the_cluster_caption_counts_its_nodes():
    templates = page_settings("/services/broker/")["pages_templates"]
    node = {"name": "n1", "gpu_type": "a100", "held": 0, "cells": [], "state": "ready"}
    html = templates.get_template("_cluster.html").render(data={"nodes": [node]})
    assert "<caption>1 node</caption>" in html
