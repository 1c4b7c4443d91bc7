"""``torch.ops.moeforge.moe_router``: the router as a torch custom op, exported as one ``moeforge.MoERouter`` node.

Eager calls run the reference (``reference.route``); the dynamo exporter maps the op to the node
through ``onnx_translation`` (pass it in ``custom_translation_table``). The node's local function is
added to the exported model by the caller (``function.attach_function``).
"""

from __future__ import annotations

import onnxscript
import torch

from moeforge.ops.moe_router import reference
from moeforge.ops.moe_router.schema import DOMAIN, PLUGIN_NAMESPACE, PLUGIN_VERSION, VERSION, RouterAttributes


@torch.library.custom_op("moeforge::moe_router", mutates_args=())
def moe_router(
    router_logits: torch.Tensor, correction_bias: torch.Tensor | None, scoring: str, top_k: int, n_group: int,
    topk_group: int, group_scoring: str, norm_topk_prob: int, routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits (+ [E] bias) -> expert ids [T, top_k] int32, weights [T, top_k] float32."""
    # The op's schema is inferred from plain str/int/float parameters; from_mapping types them.
    attrs = RouterAttributes.from_mapping({
        "scoring": scoring, "top_k": top_k, "n_group": n_group, "topk_group": topk_group,
        "group_scoring": group_scoring, "norm_topk_prob": norm_topk_prob,
        "routed_scaling_factor": routed_scaling_factor,
    })
    return reference.route(router_logits, correction_bias, attrs)


@moe_router.register_fake
def _moe_router_fake(router_logits: torch.Tensor, correction_bias: torch.Tensor | None, scoring: str, top_k: int,
                     *args: object) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = router_logits.shape[0]
    return (router_logits.new_empty((tokens, top_k), dtype=torch.int32),
            router_logits.new_empty((tokens, top_k), dtype=torch.float32))


_opset = onnxscript.values.Opset(DOMAIN, VERSION)


def onnx_translation(  # type: ignore[no-untyped-def]  # tensors unannotated: the exporter reads annotations
    router_logits, correction_bias, scoring: str, top_k: int, n_group: int, topk_group: int, group_scoring: str,
    norm_topk_prob: int, routed_scaling_factor: float,
):
    """custom_translation_table entry: one ``moeforge.MoERouter`` node (empty bias input when None)."""
    return _opset.MoERouter(
        router_logits, correction_bias, scoring=scoring, top_k=top_k, n_group=n_group, topk_group=topk_group,
        group_scoring=group_scoring, norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor,
        plugin_version=PLUGIN_VERSION, plugin_namespace=PLUGIN_NAMESPACE,
    )


def call(router_logits: torch.Tensor, correction_bias: torch.Tensor | None,
         attrs: RouterAttributes) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.moeforge.moe_router`` with typed attributes."""
    ids, weights = torch.ops.moeforge.moe_router(
        router_logits, correction_bias, attrs.scoring, attrs.top_k, attrs.n_group, attrs.topk_group,
        attrs.group_scoring, int(attrs.norm_topk_prob), float(attrs.routed_scaling_factor))
    return ids, weights
