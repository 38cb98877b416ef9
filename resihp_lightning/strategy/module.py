"""The LightningModule contract of :class:`~resihp_lightning.strategy.strategy.ResiHPStrategy`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn

from resihp_lightning.strategy.options import GATHER_WEIGHTS

REQUIRED = ("pipeline_layers", "pipeline_loss")
#: Lightning step methods the strategy runs itself; a module must not override them.
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


class ResiHPModuleMixin:
    """The contract methods of :class:`ResiHPModule`, independent of the Lightning package.

    :class:`ResiHPModule` combines it with ``lightning.pytorch.LightningModule``;
    :class:`resihp_lightning.strategy.standalone.ResiHPModule` with ``pytorch_lightning.LightningModule``.
    """

    #: Raised when the module is used the wrong way (the Lightning package's own exception type).
    misconfiguration_error: type[Exception] = MisconfigurationException

    def pipeline_layers(self) -> Sequence[nn.Module | Any]:
        """The model's layers in order (see :class:`ResiHPModule`)."""
        raise NotImplementedError

    def pipeline_loss(self, outputs: Any, labels: Any) -> Tensor:
        """The mean loss of one micro-batch (see :class:`ResiHPModule`)."""
        raise NotImplementedError

    def pipeline_tied_parameters(self) -> Sequence[Sequence[str]]:
        """Groups of parameters that are one parameter (see :class:`ResiHPModule`); default: none."""
        return ()

    def pipeline_load_layer(self, index: int, layer: nn.Module, device: Any) -> None:
        """Gives a layer built on the meta device its values (see :class:`ResiHPModule`); default: refuse."""
        raise self.misconfiguration_error(
            f"pipeline_layers()[{index}] ({type(layer).__name__}) has tensors on the meta device and "
            f"{type(self).__name__} does not define pipeline_load_layer(index, layer, device) to load them"
        )

    def pipeline_split_layer(self, index: int, layer: nn.Module, group: Any) -> nn.Module:
        """This process's tensor-parallel split of ``layer`` over ``group`` (``tensor_degree`` > 1; see
        :class:`ResiHPModule`); default: none (such a job is refused)."""
        raise NotImplementedError

    def pipeline_tensor_parallel_loss(self, outputs: Any, labels: Any, group: Any) -> Tensor:
        """:meth:`pipeline_loss` on the last layer's split outputs (``tensor_degree`` > 1; see
        :class:`ResiHPModule`); default: none (such a job is refused)."""
        raise NotImplementedError

    def pipeline_tensor_parallel_degrees(self) -> Sequence[int] | None:
        """The tensor-parallel degrees every layer splits over (e.g. the divisors of the heads, key-value heads
        and vocabulary); a re-split to another degree is refused at request time. Default: ``None``, unknown
        (the split itself decides, at the step boundary)."""
        return None

    def pipeline_tensor_parallel_outputs(self, outputs: Any, group: Any) -> Any:
        """The last layer's whole outputs from its split ones, for ``trainer.predict`` (``tensor_degree`` > 1;
        see :class:`ResiHPModule`); default: none (prediction is refused)."""
        raise NotImplementedError

    def pipeline_gather_weights(self) -> str | None:
        """The module's choice for the strategy's ``gather_weights="auto"`` (see :class:`ResiHPModule`); default none."""
        return None

    def pipeline_batch(self, batch: Any) -> tuple[Any, Any, Tensor | None]:
        """Default: ``batch`` is ``(inputs, labels)`` or, for ``trainer.predict``, the inputs alone: a tensor
        or a one-element sequence holding it (what a ``DataLoader`` over ``TensorDataset(x)`` yields)."""
        if isinstance(batch, Tensor):
            return batch, None, None
        if isinstance(batch, (tuple, list)) and len(batch) == 1 and isinstance(batch[0], Tensor):
            return batch[0], None, None
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise self.misconfiguration_error(
                "the default ResiHPModule.pipeline_batch expects batches of (inputs, labels), or inputs alone for "
                "trainer.predict; "
                "override pipeline_batch(batch) -> (inputs, labels, seq_lens) for other batch layouts"
            )
        inputs, labels = batch
        return inputs, labels, None

    def cpu(self) -> Any:
        """As ``LightningModule.cpu()`` (Lightning calls it at teardown), except that tensors on the meta
        device (layers other processes hold, with per-stage loading) stay there: they have no data to move."""
        self._resihp_keep_meta = True
        try:
            return super().cpu()  # type: ignore[misc]
        finally:
            self._resihp_keep_meta = False

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        if getattr(self, "_resihp_keep_meta", False):
            inner = fn

            def fn(tensor: Any) -> Any:
                return tensor if tensor.is_meta else inner(tensor)

        return super()._apply(fn, recurse)  # type: ignore[misc]

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:  # pragma: no cover - run by the strategy
        raise self.misconfiguration_error("ResiHPModule.training_step is run by ResiHPStrategy; use Trainer(strategy='resihp')")

    def validation_step(self, batch: Any, batch_idx: int) -> None:  # pragma: no cover - run by the strategy
        raise self.misconfiguration_error("ResiHPModule.validation_step is run by ResiHPStrategy; use Trainer(strategy='resihp')")

    def test_step(self, batch: Any, batch_idx: int) -> None:  # pragma: no cover - run by the strategy
        raise self.misconfiguration_error("ResiHPModule.test_step is run by ResiHPStrategy; use Trainer(strategy='resihp')")

    def predict_step(self, batch: Any, batch_idx: int) -> Any:  # pragma: no cover - run by the strategy
        raise self.misconfiguration_error("ResiHPModule.predict_step is run by ResiHPStrategy; use Trainer(strategy='resihp')")


class ResiHPModule(ResiHPModuleMixin, LightningModule):
    """Base class of models trained with ``Trainer(strategy="resihp")``.

    A subclass provides:

    * ``pipeline_layers(self) -> Sequence[nn.Module | deepspeed.pipe.LayerSpec]`` (required): the
      model's layers in order. Each layer takes the previous layer's output (a tensor or a tuple of
      tensors) and returns a tensor or a tuple of tensors; the first layer gets the ``inputs`` of
      :meth:`~ResiHPModuleMixin.pipeline_batch`. ``nn.Module`` layers are used as they are (keep them as attributes,
      e.g. an ``nn.ModuleList``, so that ``configure_optimizers`` sees them); ``LayerSpec`` layers are
      built only on the ranks that hold them. Called once, at setup. DeepSpeed ``TiedLayerSpec`` layers
      are not accepted; tie parameters with ``pipeline_tied_parameters`` instead.
    * ``pipeline_tied_parameters(self) -> Sequence[Sequence[str]]`` (optional): groups of parameters
      that are one parameter used in several layers, each named ``"<layer index>.<name in the
      layer>"`` — e.g. ``[("0.embed_tokens.weight", "9.lm_head.weight")]`` for tied input and output
      embeddings. Each layer keeps its own copy; the copies start equal (the first one's value), get
      the summed gradient and identical updates, so training is that of one shared parameter.
      Needs the plain fp32 optimizer (no ZeRO / bf16 / fp16).
    * ``pipeline_loss(self, outputs, labels) -> Tensor`` (required): the mean loss over one
      micro-batch, computed on the last stage from the last layer's outputs.
    * ``pipeline_batch(self, batch) -> (inputs, labels, seq_lens)`` (optional): turns a batch from the
      DataLoader into ``inputs`` (a tensor or tuple of tensors, rows on dim 0), ``labels`` (a tensor or
      tuple of tensors, rows on dim 0) and ``seq_lens`` (``None`` or a zero-padded ``[rows, max_docs]``
      LongTensor of per-document lengths: the workload the straggler detector needs). The default
      takes ``batch = (inputs, labels)``, or a tensor of inputs without labels (for prediction). A
      global batch holds M x micro_batch_size rows.
    * ``pipeline_load_layer(self, index, layer, device) -> None`` (optional): layers may be built on
      the meta device (``with torch.device("meta"): ...``: shapes, no storage), so that no process
      holds weights it does not need. When the strategy builds a process's pipeline it calls this for
      every ``nn.Module`` layer the process holds that still has tensors on meta; it must give those
      tensors storage on ``device`` and their values (e.g. read that layer's tensors from a
      checkpoint), keeping the ``Parameter`` objects (``torch.utils.swap_tensors``; see
      :mod:`resihp_lightning.torch_utils.meta`). Layers a re-plan moves to a process are not loaded: they get
      empty storage and their values (and optimizer state) from their previous holder, and a process
      that gives a layer away puts it back on meta. Non-persistent buffers (rotary frequencies, ...)
      travel nowhere, so they must be built on a real device. The other layers stay on meta in that
      process's module; checkpoints and the end-of-``fit`` gather take them from their holders.
    * ``pipeline_gather_weights(self) -> str | None`` (optional): what the strategy's
      ``gather_weights="auto"`` (the default) means for this module: ``"all"``, ``"rank0"``, ``"none"``,
      or ``None`` for the default ``"all"``. A module whose layers are loaded per stage returns
      ``"none"``, so that no rank assembles the whole model at the end of ``fit``.
    * ``pipeline_split_layer(self, index, layer, group) -> nn.Module`` and
      ``pipeline_tensor_parallel_loss(self, outputs, labels, group) -> Tensor`` (only for
      ``ResiHPStrategy(tensor_degree=t)``, t > 1): the first returns this process's share of layer
      ``index`` split over the tensor-parallel process ``group`` (it gets a private copy of the unsplit
      layer and may change it in place); parameters cut into shards carry the dimension they are cut
      along (:func:`resihp_lightning.torch_utils.shards.sharded_parameter`), every other parameter must stay whole
      and equal on the group's members. The second is ``pipeline_loss`` on the split last layer's
      outputs, the same value on every member. ``pipeline_tensor_parallel_outputs(self, outputs, group)``
      (for ``trainer.predict``) joins the members' split outputs of one micro-batch into the whole ones.
      ``CausalLMPipelineModule`` defines all three (Megatron-style splits,
      :mod:`resihp_lightning.models.tensor_parallel`).
    * ``configure_optimizers`` as usual (one optimizer, optionally LR schedulers). Use
      ``self.parameters()``; the strategy keeps only the parameters of this rank's layers, and the
      optimizer and its schedulers keep working across re-plans.

    ``training_step``, ``validation_step`` and ``test_step`` are run by the strategy through
    DeepSpeed's ``PipelineEngine``; it logs ``train_loss`` (per step and per epoch, progress bar),
    ``val_loss`` and ``test_loss`` (per epoch). ``trainer.predict`` returns, for every batch and on
    every rank, the last layer's outputs for all rows of the batch in row order (as one device would);
    ``pipeline_loss`` is not called there and labels may be ``None``. ``backward``-related hooks
    (``on_before_backward``, ``on_after_backward``, ``on_before_optimizer_step``) are not called: the
    engine runs the backward pass and the optimizer step itself. Trainer gradient clipping is not
    applied by Lightning; ``Trainer(gradient_clip_val=..., gradient_clip_algorithm="norm")`` becomes the
    pipeline's exact global-norm clipping, and ``Trainer(precision="bf16-mixed" | "bf16-true")`` DeepSpeed's
    bf16 mode. Overriding ``training_step`` / ``validation_step`` / ``test_step`` / ``predict_step`` is
    refused at setup (the strategy never calls them); ``self.log`` works inside ``pipeline_loss``.

    After ``trainer.fit`` the module holds the trained weights of every layer given as an
    ``nn.Module`` (on the ranks named by the strategy's ``gather_weights`` option: by default all,
    unless ``pipeline_gather_weights`` says otherwise), and
    checkpoints use the module's own ``state_dict`` keys, so ``Model.load_from_checkpoint(path)`` works
    in a plain process. ``LayerSpec`` layers exist only on the ranks that hold them; their tensors are
    saved under ``"pipeline_layers.<index>.<name>"``.
    """


def check_contract(module: Any, error: type[Exception] = MisconfigurationException) -> None:
    """Raises ``error`` naming the contract methods ``module`` does not provide."""
    missing = []
    for name in REQUIRED:
        method = getattr(type(module), name, None)
        if method is None or method is getattr(ResiHPModuleMixin, name):
            missing.append(name)
    if missing:
        raise error(
            f"{type(module).__name__} does not implement {', '.join(m + '()' for m in missing)}, which "
            "ResiHPStrategy needs: subclass resihp_lightning.ResiHPModule and define "
            "pipeline_layers(self) -> list of layers in model order and "
            "pipeline_loss(self, outputs, labels) -> mean loss of a micro-batch"
        )
    overridden = [name for name in STEP_METHODS if getattr(type(module), name, None) is not getattr(ResiHPModuleMixin, name)]
    if overridden:
        raise error(
            f"{type(module).__name__} overrides {', '.join(m + '()' for m in overridden)}, which ResiHPStrategy "
            "never calls: the pipeline engine runs each micro-batch through pipeline_layers() and pipeline_loss(). "
            "Put the loss in pipeline_loss (self.log works there), the batch layout in pipeline_batch, and remove "
            "the override"
        )


def layer_specs(module: Any, error: type[Exception] = MisconfigurationException) -> list[Any]:
    """``module.pipeline_layers()`` checked: a non-empty list of ``nn.Module`` / DeepSpeed ``LayerSpec``."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    specs = list(module.pipeline_layers())
    if not specs:
        raise error(f"{type(module).__name__}.pipeline_layers() returned no layers")
    for i, spec in enumerate(specs):
        if isinstance(spec, TiedLayerSpec):
            raise error(
                f"pipeline_layers()[{i}] is a TiedLayerSpec; give plain layers and name the shared parameters in "
                "pipeline_tied_parameters() instead"
            )
        if not isinstance(spec, (nn.Module, LayerSpec)):
            raise error(f"pipeline_layers()[{i}] is a {type(spec).__name__}; layers must be nn.Module or deepspeed LayerSpec")
    return specs


def tied_parameters(
    module: Any, num_layers: int, error: type[Exception] = MisconfigurationException
) -> list[tuple[tuple[int, str], ...]]:
    """``module.pipeline_tied_parameters()`` as ``(layer, name)`` groups, checked against ``num_layers``."""
    getter = getattr(module, "pipeline_tied_parameters", None)
    groups = list(getter() or ()) if getter is not None else []
    out = []
    for g, group in enumerate(groups):
        keys = [group] if isinstance(group, str) else list(group)
        if len(keys) < 2:
            raise error(f"pipeline_tied_parameters()[{g}] names {len(keys)} parameter; a tie needs at least two")
        members = []
        for key in keys:
            layer, sep, name = str(key).partition(".")
            if not sep or not name or not layer.isdigit() or int(layer) >= num_layers:
                raise error(
                    f"pipeline_tied_parameters()[{g}]: {key!r} is not '<layer index>.<parameter name>' with a "
                    f"layer index below {num_layers}"
                )
            members.append((int(layer), name))
        out.append(tuple(members))
    return out


def resolve_gather_weights(option: str, module: Any, error: type[Exception] = MisconfigurationException) -> str:
    """The strategy's ``gather_weights`` for ``module``: ``"auto"`` becomes the module's
    ``pipeline_gather_weights()`` (``"all"`` when it has no preference); other values stay."""
    if option != "auto":
        return option
    getter = getattr(module, "pipeline_gather_weights", None)
    preferred = getter() if getter is not None else None
    if preferred is None:
        return "all"
    allowed = tuple(choice for choice in GATHER_WEIGHTS if choice != "auto")
    if preferred not in allowed:
        raise error(f"{type(module).__name__}.pipeline_gather_weights() returned {preferred!r}; allowed: "
                    f"{', '.join(repr(choice) for choice in allowed)}, None")
    return str(preferred)
