"""Where the JAX Krylov kernels' time goes: their pieces, step by step, on the machine's JAX
device (a GPU where there is one).

Each row is the µs per step of a jitted ``lax.scan`` of 400 steps, as a sampler's block runs
them, on P1-sized low-rank parts (G of 500 x 100, float32 rows as mCCAdL reads them by
default): one covariance-vector product, three (straight-line code and a while loop: the
loop's cost per iteration), an 8 x 8 eigen-decomposition (JAX's default and the QR
algorithm), the Taylor series that replaces it for short Lanczos runs
(``jax_compile._expm_e1_taylor``, in one substep and in four), and
``jax_compile.lanczos_expm`` and ``shifted_cg`` as they are and as they were before
(``gpu.previous_krylov_kernels``: the series in one substep only, a wider T taking the
eigen-decomposition), at a t where Lanczos stops after 3 products with a narrow T, one
where it stops after 6 with a T of norm 1.4 (as on D = 1,000, ``gpu.py``'s P1x10), and an
operator where CG stops after about 5 iterations::

    python benchmarks/jax_krylov.py [--output benchmarks/jax_krylov_results.md]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))

from gpu import previous_krylov_kernels  # noqa: E402
from report import header, output_path, write  # noqa: E402

ROWS, DIM, STEPS, REPEATS = 500, 100, 400, 7
#: mCCAdL's default Lanczos tolerance ("half") and cap.
U, CAP = 2.0**-11, 64
#: t (narrow and wide shifted T) and the CG operator's diagonal and gain (on Gc^T Gc / (n - 1))
#: for the counts above.
T, T_WIDE, CG_DIAGONAL, CG_GAIN = 0.1, 1.5, 1.0, 0.18


def pieces():
    """name -> f(parts, v) -> vector, and the parts (device arrays)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from pymc_sgmcmc import jax_compile as jc

    rng = np.random.default_rng(0)
    g = rng.normal(size=(ROWS, DIM)).astype("float32")
    parts = (g, g.astype("float64").mean(0), np.ones(DIM), np.float64(1 / (ROWS - 1)))

    def operator(p):
        return jc._low_rank_operator(*p, np.zeros(DIM))

    def small_tridiagonal(v):  # an 8 x 8 tridiagonal matrix that changes with v
        return v[:8], jnp.concatenate([v[8:15], jnp.zeros(1)])

    def eigh(implementation):
        def run(p, v):
            diagonal, off = small_tridiagonal(v)
            matrix = jnp.diag(diagonal) + jnp.diag(off[:-1], 1) + jnp.diag(off[:-1], -1)
            values, vectors = lax.linalg.eigh(matrix, implementation=implementation)
            return v.at[:8].add(1e-3 * (vectors @ (jnp.exp(-T * values) * vectors[0])))

        return run

    def taylor(substeps):
        def run(p, v):
            diagonal, off = small_tridiagonal(v)
            series, _ = jc._shifted_tridiagonal(diagonal, off, jnp.asarray(8), 0.01)
            return v.at[:8].add(1e-3 * jc._expm_e1_taylor(*series, substeps))

        return run

    def lanczos(t):
        def run(p, v):
            return jc.lanczos_expm(*p, np.zeros(DIM), t, v, U, CAP)[0]

        return run

    def cg(p, v):
        g, mean, columns, gain = p
        return jc.shifted_cg(
            g, mean, columns, CG_GAIN * gain, np.full(DIM, CG_DIAGONAL), v, 1e-6, 50
        )

    def previous(kernel):
        def run(p, v):
            with previous_krylov_kernels():  # read when traced
                return kernel(p, v)

        return run

    def products(k, loop):
        def run(p, v):
            apply = operator(p)
            if loop:
                return lax.while_loop(
                    lambda s: s[0] < k, lambda s: (s[0] + 1, apply(s[1])), (0, v)
                )[1]
            for _ in range(k):
                v = apply(v)
            return v

        return run

    Eigh = lax.linalg.EighImplementation
    table = {
        "one product": products(1, False),
        "three products, straight-line": products(3, False),
        "three products, while loop": products(3, True),
        "eigh 8 x 8 (default)": eigh(None),
        "eigh 8 x 8 (QR)": eigh(Eigh.QR),
        "Taylor series 8 x 8 (_expm_e1_taylor)": taylor(1),
        "Taylor series 8 x 8, 4 substeps": taylor(4),
        "lanczos_expm": lanczos(T),
        "lanczos_expm, previous": previous(lanczos(T)),
        f"lanczos_expm, t = {T_WIDE}": lanczos(T_WIDE),
        f"lanczos_expm, t = {T_WIDE}, previous": previous(lanczos(T_WIDE)),
        "shifted_cg": cg,
    }
    return table, tuple(jax.device_put(a) for a in parts)


def per_step(fn, parts) -> tuple[float, float]:
    """Median µs per step of the scanned kernel, and the first call's seconds (compile)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    def block(v0, noise, parts):
        def body(v, x):
            out = fn(parts, v + x)
            return out / jnp.sqrt(jnp.sum(out * out)), None

        return lax.scan(body, v0, noise)[0]

    jitted = jax.jit(block)
    rng = np.random.default_rng(1)
    v0 = jax.device_put(rng.normal(size=DIM))
    noise = jax.device_put(1e-3 * rng.normal(size=(STEPS, DIM)))
    start = time.perf_counter()
    jitted(v0, noise, parts).block_until_ready()
    first = time.perf_counter() - start
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        jitted(v0, noise, parts).block_until_ready()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times) / STEPS, first


def main() -> None:
    output = output_path(__doc__)
    import jax

    jax.config.update("jax_enable_x64", True)
    from pymc_sgmcmc import jax_compile as jc

    table, parts = pieces()
    counts = [
        int(jc.lanczos_expm(*parts, np.zeros(DIM), t, np.ones(DIM), U, CAP)[1]) for t in (T, T_WIDE)
    ]
    lines = header("The JAX Krylov kernels, piece by piece (`benchmarks/jax_krylov.py`)")
    lines += [
        f"- JAX device: {jax.devices()[0]} ({jax.devices()[0].device_kind})",
        f"- Lanczos products at t = {T} and {T_WIDE}: {counts[0]} and {counts[1]}",
        "",
        "| piece | µs per step | first call s |",
        "| --- | --- | --- |",
    ]
    for name, fn in table.items():
        us, first = per_step(fn, parts)
        lines.append(f"| {name} | {us:.1f} | {first:.2f} |")
        print(lines[-1], flush=True)
    write(lines, output)


if __name__ == "__main__":
    main()
