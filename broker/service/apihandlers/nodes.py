"""Nodes: the inventory and its states; admins drain, undrain and down them (design.md §6)."""

from __future__ import annotations

from ...core.model import NodeState
from .base import NAME_PARAM, APIHandler, Operation

#: What each admin action on a node makes its state (the API's routes and the pages' buttons).
NODE_ACTIONS = {"drain": NodeState.DRAINING, "undrain": NodeState.READY, "down": NodeState.DOWN}


class NodeListHandler(APIHandler):
    operations = {
        "get": Operation(
            "List nodes",
            "Every node with its GPU type, GPU count, weight, state (and why and since "
            "when) and the GPUs held on it.",
            content={"application/json": "NodeList"},
        )
    }

    async def get(self) -> None:
        broker = self.broker
        nodes = await self.runner.read_committed(broker.committed_nodes, broker.nodes)
        self.write_json({"nodes": nodes})


def _node_operation(summary: str, description: str) -> dict:
    return {
        "post": Operation(
            summary,
            description + " Admins only. The body (optional) may give a `reason`.",
            auth="admin",
            parameters=(NAME_PARAM,),
            body="NodeChange",
            body_required=False,
            content={"application/json": "Node"},
            errors=(400, 404, 409),
        )
    }


class _NodeStateHandler(APIHandler):
    target: NodeState

    async def post(self, name: str) -> None:
        name = self.path_param("name", name)
        body = self.body()
        node = await self.runner.change(
            self.broker.set_node_state, name, self.target.value, body.get("reason") or ""
        )
        self.write_json(node)


class NodeDrainHandler(_NodeStateHandler):
    target = NODE_ACTIONS["drain"]
    operations = _node_operation(
        "Drain a node",
        "No new grants; each slice on it is preempted as its protection ends; once "
        "empty the node reports `drained`. The drain holds until an admin undrains the "
        "node, whatever a live inventory (Kubernetes) says, except that the node is gone "
        "or not ready (`down`).",
    )


class NodeUndrainHandler(_NodeStateHandler):
    target = NODE_ACTIONS["undrain"]
    operations = _node_operation(
        "Put a node back in service",
        "The node becomes `ready`, and a live inventory (Kubernetes) rules its state again: "
        "a node still cordoned goes back to `draining` at the next inventory change.",
    )


class NodeDownHandler(_NodeStateHandler):
    target = NODE_ACTIONS["down"]
    operations = _node_operation(
        "Mark a node down",
        "Its slices end at once (reason `node_down`; resumable batch slices requeue). It "
        "stays out of service until an admin undrains it: when a live inventory "
        "(Kubernetes) shows it up, it becomes `draining`, then `drained`.",
    )


default_handlers = [
    ("/nodes", NodeListHandler),
    ("/nodes/{name}/drain", NodeDrainHandler),
    ("/nodes/{name}/undrain", NodeUndrainHandler),
    ("/nodes/{name}/down", NodeDownHandler),
]
