"""muP on the decoder, with Microsoft's ``mup`` package's infshape logic.

mup keeps each parameter's ``InfShape`` (which dimensions are widths, and their base sizes) on
the parameter (``p.infshape``, set by ``mup.set_base_shapes``). FSDP2 and tensor parallelism
replace the parameters with DTensors, which lose such attributes; so the shapes are taken by
parameter name from the base shapes (``MupScales.base_shapes``) against the whole parameter's
shape (a DTensor's ``shape`` is the global one), here, once per use: the initialisation and
the optimizer's groups see the same InfShape in every layout."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from mup.infshape import InfShape, zip_infshape

from torchneox.base.errors import ConfigError
from torchneox.models.args import ModelArgs, MupScales


def infshape(mup: MupScales, name: str, shape: Sequence[int], bases: dict | None = None):
    """Parameter ``name``'s InfShape: its base shape from the base shapes file, zipped with its
    whole shape ``shape`` (mup's ``zip_infshape``). ``bases``: ``dict(mup.base_shapes)``,
    when the caller looks up many names."""
    base = (bases if bases is not None else dict(mup.base_shapes)).get(name)
    if base is None or len(base) != len(shape):
        raise ConfigError(
            f"holds no base shape for {name} {tuple(shape)}: this model is not the one the "
            "file was written for (or the file lost it); write it again with save_base_shapes: "
            "true at the base width",
            source=mup.file,
            key="base_shapes_file",
        )
    return zip_infshape(InfShape.from_base_shape(list(base)), list(shape))


def init_factor(mup: MupScales, name: str, shape: Sequence[int]) -> float:
    """What muP multiplies a drawn weight by (mup.init's normal_, as GPT-NeoX re-draws its
    weights): a hidden matrix (two width dimensions) 1/sqrt(width multiplier), the rest 1;
    every drawn weight x mup_init_scale."""
    shape_inf = infshape(mup, name, shape)
    factor = shape_inf.width_mult() ** -0.5 if shape_inf.ninf() == 2 else 1.0
    return factor * mup.init_scale


def scalings_of(args: ModelArgs, names: Iterable[tuple[str, Sequence[int]]]) -> dict[str, InfShape]:
    """The InfShape of each (name, whole shape)."""
    assert args.mup is not None
    bases = dict(args.mup.base_shapes)
    return {name: infshape(args.mup, name, shape, bases) for name, shape in names}
