"""FlexAttention score_mods read from their traced graph: which ones the splash kernels serve.

Splash applies, to each logit q.k, a softmax scale, then optionally a soft cap
``cap * tanh(x / cap)``, then a mask. A score_mod is served when its traced graph (aten ops, from
`_compat.score_mod_graph`) is a chain of exactly those steps applied to the score:

- the identity (torch's own ``_identity``, a user's no-op);
- multiplication or division by a Python number or a captured one-element tensor: folded into the
  scale;
- one ``tanh``, itself between such factors: ``M * tanh(a * score)`` is the kernel's soft cap with
  cap M (positive) on the logits scaled by a * M, which is what ``torch_splash.soft_cap`` traces to;
- ``torch.where(pred, score, -inf)`` (or ``masked_fill(pred, -inf)``) with ``pred`` a function of
  (b, h, q_idx, kv_idx) and captured tensors only: a mask, served as the mask_mod
  ``score_mod(0, b, h, q_idx, kv_idx) != -inf``, combined with the BlockMask's own.

The order matters as it does in torch: a soft cap applied after the mask turns -inf into -cap, which
torch attends to, so that is refused, as is a negative factor after the mask (-inf becomes +inf).
Everything else (a bias added to the score, a factor that depends on the indices, ...) is refused
with the operation that cannot be served.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from torch_splash_jax import SplashConstraintError

from . import _compat

_aten = torch.ops.aten
_PASS = _compat.value_preserving_ops()
_MUL, _DIV = {_aten.mul.Tensor, _aten.mul.Scalar}, {_aten.div.Tensor, _aten.div.Scalar}


@dataclasses.dataclass(frozen=True)
class ScoreForm:
    """What a served score_mod does: the logits are multiplied by `factor` (before any soft cap),
    soft-capped with `cap` (None: not), and masked to -inf where `masks` (then the score_mod
    itself, at a score of 0, says where). `reads`: whether its mask reads (b, h, q_idx, kv_idx).
    `captured`: whether the factor came from a captured tensor (its value at this call)."""

    factor: float = 1.0
    cap: float | None = None
    masks: bool = False
    reads: tuple = (False, False, False, False)
    captured: bool = False


IDENTITY = ScoreForm()


class _Refused(Exception):
    pass


@dataclasses.dataclass
class _Score:
    """A node's value that depends on the score: ``multiplier * tanh(factor * score)`` when
    `capped`, else ``factor * score``; -inf where a mask applied."""

    factor: float = 1.0
    capped: bool = False
    multiplier: float = 1.0
    masked: bool = False


_NEG_INF = object()  # a constant -inf


def _name(fn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _number(value, nodes) -> tuple[float, bool] | None:
    """A factor: (its value, whether it is a captured tensor), or None if it is none."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value), False
    if isinstance(value, torch.fx.Node) and nodes.get(value, (None,))[0] == "tensor":
        tensor = nodes[value][1]
        if tensor.numel() == 1 and (tensor.is_floating_point() or not tensor.dtype.is_complex):
            return float(tensor), True
    return None


def analyse(score_mod, device) -> ScoreForm:
    """The ScoreForm of a score_mod, or a SplashConstraintError naming what splash cannot serve."""
    try:
        graph = _compat.score_mod_graph(score_mod, device)
    except Exception as error:  # noqa: BLE001  reported to the user with its cause
        raise SplashConstraintError(
            f"score_mod {_name(score_mod)!r} could not be traced ({type(error).__name__}: {error}), so "
            "splash cannot tell whether it serves it: write it with torch operations on its arguments."
        ) from None
    try:
        return _form(graph)
    except _Refused as why:
        raise SplashConstraintError(
            f"score_mod {_name(score_mod)!r}: {why} Splash serves score_mods that are the identity, "
            "that multiply the score by a number (folded into the scale), torch_splash.soft_cap, and "
            "torch.where(mask of (b, h, q_idx, kv_idx), score, -inf) (served as a mask); this one has "
            "no splash kernel."
        ) from None


def _form(graph) -> ScoreForm:
    nodes: dict = {}
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    captured = False
    for node in graph.graph.nodes:
        if node.op == "placeholder":
            nodes[node] = ("score", _Score()) if node is placeholders[0] else ("index", None)
        elif node.op == "get_attr":
            nodes[node] = ("tensor", getattr(graph, node.target))
        elif node.op == "call_function":
            args = [a for a in node.args if isinstance(a, torch.fx.Node)]
            scored = [a for a in args if nodes[a][0] == "score"]
            if not scored:
                is_inf = node.target == _aten.scalar_tensor.default and node.args[0] == -math.inf
                moved = node.target in _PASS and args and nodes[args[0]][0] == "neg_inf"
                nodes[node] = ("neg_inf", None) if is_inf or moved else ("index", None)
                continue
            nodes[node], from_tensor = _apply(node, nodes)
            captured = captured or from_tensor
        elif node.op == "output":
            (result,) = node.args if not isinstance(node.args[0], (tuple, list)) else node.args[0]
            kind, value = nodes.get(result, ("index", None)) if isinstance(result, torch.fx.Node) else ("index", None)
            if kind != "score":
                raise _Refused("it returns no function of the score.")
            return _result(value, placeholders, graph, captured)
    raise _Refused("its graph has no output.")


def _apply(node, nodes) -> tuple[tuple, bool]:
    op, args = node.target, node.args
    kind_of = lambda a: nodes[a][0] if isinstance(a, torch.fx.Node) else "constant"  # noqa: E731
    if op in _PASS and len(args) == 1:
        dtype = node.kwargs.get("dtype")
        if dtype is None or dtype == torch.float32:  # a copy or move; another dtype rounds
            return ("score", dataclasses.replace(nodes[args[0]][1])), False
    if op in _MUL | _DIV and len(args) == 2:
        score_at = 0 if kind_of(args[0]) == "score" else 1
        other = args[1 - score_at]
        number = _number(other, nodes)
        if kind_of(args[1 - score_at]) == "score":
            raise _Refused(f"{op} multiplies the score by itself.")
        if number is None or (op in _DIV and score_at == 1):
            raise _Refused(f"{op} of the score by a tensor of (b, h, q_idx, kv_idx), not one number.")
        value, from_tensor = number
        if op in _DIV:
            if value == 0:
                raise _Refused(f"{op} of the score by 0.")
            value = 1.0 / value
        score = dataclasses.replace(nodes[args[score_at]][1])
        if score.masked and not value > 0:
            raise _Refused(f"{op} by {value} after the mask turns its -inf into +inf or nan.")
        if score.capped:
            score.multiplier *= value
        else:
            score.factor *= value
        return ("score", score), from_tensor
    if op == _aten.tanh.default:
        score = dataclasses.replace(nodes[args[0]][1])
        if score.masked:
            raise _Refused("tanh (a soft cap) after the mask gives -cap where the mask gave -inf: torch attends there.")
        if score.capped:
            raise _Refused("tanh of a soft-capped score: one soft cap only.")
        score.capped = True
        return ("score", score), False
    masked = _masked_value(op, args, kind_of)
    if masked is not None:
        score = dataclasses.replace(nodes[masked][1], masked=True)
        return ("score", score), False
    raise _Refused(f"{op} of the score (a bias, or an operation splash has no kernel for).")


def _masked_value(op, args, kind_of):
    """The score node a masking op (where / masked_fill with -inf) keeps, or None."""
    neg_inf = lambda a: kind_of(a) == "neg_inf" or (isinstance(a, float) and a == -math.inf)  # noqa: E731
    if op in (_aten.where.self, _aten.where.ScalarOther, _aten.where.ScalarSelf) and len(args) == 3:
        pred, a, b = args
        if kind_of(pred) == "index":
            if kind_of(a) == "score" and neg_inf(b):
                return a
            if kind_of(b) == "score" and neg_inf(a):
                return b
    if op in (_aten.masked_fill.Scalar, _aten.masked_fill.Tensor) and len(args) == 3:
        value, pred, fill = args
        if kind_of(value) == "score" and kind_of(pred) == "index" and neg_inf(fill):
            return value
    return None


def _result(score: _Score, placeholders, graph, captured: bool) -> ScoreForm:
    factor, cap = score.factor, None
    if score.capped:
        if not score.multiplier > 0:
            raise _Refused(f"a soft cap with the factor {score.multiplier}: the cap must be positive.")
        factor, cap = score.factor * score.multiplier, score.multiplier
    reads = (False,) * 4
    if score.masked:
        # which indices the mask reads: those the graph uses at all (the score is placeholder 0)
        reads = tuple(bool(node.users) for node in placeholders[1:])
    return ScoreForm(factor=factor, cap=cap, masks=score.masked, reads=reads, captured=captured)


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class ScoreMask:
    """The mask a masking score_mod means, as a mask_mod: where it gives -inf at a score of 0."""

    score_mod: object
    # vmap names the function it maps, which Dynamo must trace: a name, not a dataclass repr
    __name__ = "score_mod_mask"

    def __call__(self, b, h, q_idx, kv_idx):
        score = torch.zeros((), device=q_idx.device)
        return ~torch.isneginf(self.score_mod(score, b, h, q_idx, kv_idx))
