"""Programmatic dependent launch (PDL, Hopper) between the kernels of a decode step.

A Mosaic GPU kernel that calls `plgpu.griddepcontrol_wait()` is launched with PDL (jax marks its module
`mosaic_gpu.uses_pdl`): it may start while the kernel in front of it still runs, and waits at that call until the
kernel in front has finished and its writes are visible. What it does before the wait overlaps the kernel in front:
pallas_kernels.skinny_matmul requests its weight tiles there, which no kernel of the step writes.

The kernel in front lets it start early by executing `griddepcontrol.launch_dependents` in every CTA; without that
the dependent starts only as the kernel in front's CTAs exit. `released_zero` is that instruction for Pallas Triton
kernels (which have no primitive for it): inline PTX that returns an int32 zero the compiler cannot see through.
Pallas marks inline assembly pure, so an unused result would be deleted and a late use would let the compiler sink
it; added to the index of the kernel's first load, it runs before that load, at the top of the kernel, and the
dependent's CTAs fill the SMs the kernel leaves idle. In a kernel not followed by a PDL launch it does nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def released_zero() -> jax.Array:
    """An int32 0, after this Triton program has executed griddepcontrol.launch_dependents; add it to the first
    load's index (module docstring)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as plt

    # A value the asm takes, so that its result is not a constant; a one-element block, since Triton's inline
    # assembly gives a 0-d block for a scalar, which Pallas's index arithmetic does not take: reduced back.
    zero = jnp.full((1,), pl.program_id(0) * 0, jnp.int32)
    (out,) = plt.elementwise_inline_asm("griddepcontrol.launch_dependents;\n\tmov.b32 $0, $1;", args=[zero],
                                        constraints="=r,r", pack=1,
                                        result_shape_dtypes=[jax.ShapeDtypeStruct((1,), jnp.int32)])
    return jnp.max(out)
