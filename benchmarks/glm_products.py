"""Could a GLM's covariance products skip writing G? Kernels timed on their own, D = 100, n = 500.

A generalised linear model's per-observation gradients are ``r_i x_i``: the row of the data
times the row's residual (its weight in the summed gradient). So a product with the noise
covariance, ``Sigma v ∝ sum_i (g_i . v - m . v) g_i``, could read the minibatch rows of the
data through the residuals that SGLD's single pass over the rows computes anyway, instead of
the n x D gradients G that mCCAdL's and NOGIN's blocks write in float32 at every step. This
script models both ways in compiled numba loops (the smallest of 25 runs of 2,000 minibatches,
the variants alternated, as ``product_floor.py`` times its pieces):

- SGLD's pass over the rows alone (``gather_dot.GatherGLMProduct``'s loop);
- the blocks' way: the predictor, then G written in float32 with its column sums, then k
  products with G (``gram_product._centred_gram``);
- G never written: SGLD's pass keeping the residuals, then k products reading the rows of the
  float64 data in place (the pass has just brought them into the L2 cache), or of a float32
  copy of the data (half the bytes, but rows the pass did not read);

for k = 2 (mCCAdL's Lanczos step at the step size the defaults adapt) and k = 5 (NOGIN's
conjugate gradients at h = 1e-3). Each model's time over SGLD's pass, added to SGLD's whole
step in its compiled block (``covariance.py``'s measurement, P1's model, in the same run),
gives a lower bound on the sampler's cost in SGLD steps: the Krylov bookkeeping (about
2.4 µs for mCCAdL's 3 products in ``krylov.LowRankExpm``) and the integrator's vector
operations come on top. The issue's target is 1.6.

Run: ``.venv/bin/python benchmarks/glm_products.py [--output
benchmarks/glm_products_results.md]`` (about a minute).
"""

from __future__ import annotations

import single_thread  # noqa: F401  (before NumPy: one thread per runtime)

# isort: split

import covariance
import numba
import numpy as np
from product_floor import BATCH, DIM, N_OBS, alternated_us, residuals
from report import header, output_path, write

from pymc_sgmcmc.gram_product import _centred_gram

#: Products per step: mCCAdL's Lanczos step at the adapted h, NOGIN's conjugate gradients.
PRODUCT_COUNTS = (2, 5)


@numba.njit(fastmath=True)
def force_pass(x, y, idx, w, r, force):
    """SGLD's single pass over the rows, four at a time: each row's residual, kept in ``r``,
    then the row added to the force while it is still in the L1 cache."""
    n, d = idx.shape[0], x.shape[1]
    force[:] = 0
    for i in range(0, n - n % 4, 4):
        r0, r1, r2, r3 = x[idx[i]], x[idx[i + 1]], x[idx[i + 2]], x[idx[i + 3]]
        s0 = s1 = s2 = s3 = 0.0
        for j in range(d):
            s0 += r0[j] * w[j]
            s1 += r1[j] * w[j]
            s2 += r2[j] * w[j]
            s3 += r3[j] * w[j]
        w0, w1 = y[idx[i]] - s0, y[idx[i + 1]] - s1
        w2, w3 = y[idx[i + 2]] - s2, y[idx[i + 3]] - s3
        r[i], r[i + 1], r[i + 2], r[i + 3] = w0, w1, w2, w3
        for j in range(d):
            force[j] += r0[j] * w0 + r1[j] * w1 + r2[j] * w2 + r3[j] * w3


@numba.njit(fastmath=True)
def weighted_gram(x, idx, r, mean, v, out):
    """``sum_i (r_i x_i . v - m . v) r_i x_i`` with the rows read from the data in place, four
    at a time (``_centred_gram``'s loop with a weight per row; the dot products of
    :func:`force_pass` written out again, not shared, as in the project's kernels: see
    ``gather_dot._GLM_KERNEL``). The centring needs no second term: the weights
    ``r_i x_i . v - m . v`` sum to zero."""
    n, d = idx.shape[0], x.shape[1]
    c = 0.0
    for j in range(d):
        c += mean[j] * v[j]
    out[:] = 0
    for i in range(0, n - n % 4, 4):
        r0, r1, r2, r3 = x[idx[i]], x[idx[i + 1]], x[idx[i + 2]], x[idx[i + 3]]
        s0 = s1 = s2 = s3 = 0.0
        for j in range(d):
            s0 += r0[j] * v[j]
            s1 += r1[j] * v[j]
            s2 += r2[j] * v[j]
            s3 += r3[j] * v[j]
        a0 = (r[i] * s0 - c) * r[i]
        a1 = (r[i + 1] * s1 - c) * r[i + 1]
        a2 = (r[i + 2] * s2 - c) * r[i + 2]
        a3 = (r[i + 3] * s3 - c) * r[i + 3]
        for j in range(d):
            out[j] += r0[j] * a0 + r1[j] * a1 + r2[j] * a2 + r3[j] * a3


@numba.njit(fastmath=True)
def next_vector(out, v):
    """The next Krylov vector ``out / |out|``: each product depends on the one before."""
    norm = np.sqrt(np.sum(out * out))
    for j in range(v.shape[0]):
        v[j] = out[j] / norm


@numba.njit(fastmath=True)
def sgld_steps(x, y, index_rows, w, rows, products):
    r, force = np.empty(index_rows.shape[1]), np.empty(x.shape[1])
    for k in range(index_rows.shape[0]):
        force_pass(x, y, index_rows[k], w, r, force)
        w[0] += force[0] * 1e-300  # a dependency between steps
    return force


@numba.njit(fastmath=True)
def written_g_steps(x, y, index_rows, w, g, products):
    """The blocks' way: the predictor, then G = r * X[idx] written into ``g`` with its column
    sums in one pass, then ``products`` products with G."""
    n, d = index_rows.shape[1], x.shape[1]
    out, v, force = np.empty(d), np.empty(d), np.empty(d)
    for k in range(index_rows.shape[0]):
        idx = index_rows[k]
        r = residuals(x, y, idx, w)
        force[:] = 0
        for i in range(n):
            row = x[idx[i]]
            for j in range(d):
                gij = row[j] * r[i]
                g[i, j] = gij
                force[j] += gij
        v[:] = w
        for _ in range(products):
            _centred_gram(g, force / n, v, out)
            next_vector(out, v)
        w[0] += (force[0] + out[0]) * 1e-300
    return out


@numba.njit(fastmath=True)
def unwritten_g_steps(x, y, index_rows, w, rows, products):
    """SGLD's pass keeping the residuals, then ``products`` products reading ``rows`` (the
    data, or a float32 copy of it) through the residuals: G is never written."""
    n, d = index_rows.shape[1], x.shape[1]
    r, out, v, force = np.empty(n), np.empty(d), np.empty(d), np.empty(d)
    for k in range(index_rows.shape[0]):
        idx = index_rows[k]
        force_pass(x, y, idx, w, r, force)
        v[:] = w
        for _ in range(products):
            weighted_gram(rows, idx, r, force / n, v, out)
            next_vector(out, v)
        w[0] += (force[0] + out[0]) * 1e-300
    return out


def sgld_block_us() -> float:
    """SGLD's CPU time per step in its compiled block at D = 100, n = 500 (P1's model,
    thin = 10): the smallest of 21 block fills."""
    problem, h = covariance.regression(DIM)
    with problem.model() as model:
        sgld = covariance.make("SGLD", h, 1.0, thin=10)
    covariance.prepared_block(problem, sgld, model)
    mean = problem.mean
    return min(covariance.block_us_per_step(sgld, mean) for _ in range(21))


def model_times(rng) -> dict[str, float]:
    """µs per minibatch of each model, alternated; checks first that both ways compute the
    same products."""
    x, y = rng.standard_normal((N_OBS, DIM)), rng.standard_normal(N_OBS)
    w = 0.1 * rng.standard_normal(DIM)
    index_rows = rng.integers(0, N_OBS, (2_000, BATCH))
    g64, g32 = np.empty((BATCH, DIM)), np.empty((BATCH, DIM), np.float32)
    written = written_g_steps(x, y, index_rows[:3], w.copy(), g64, 2)
    unwritten = unwritten_g_steps(x, y, index_rows[:3], w.copy(), x, 2)
    assert np.allclose(written, unwritten, rtol=1e-9, atol=1e-12), "the two ways differ"
    variants = {"SGLD's pass over the rows (the force)": (sgld_steps, x, 0)}
    for k in PRODUCT_COUNTS:
        variants[f"{k} products: G written in float32 (the blocks' way)"] = (
            written_g_steps,
            g32,
            k,
        )
        variants[f"{k} products: G never written, rows of the float64 data"] = (
            unwritten_g_steps,
            x,
            k,
        )
        variants[f"{k} products: G never written, rows of a float32 copy"] = (
            unwritten_g_steps,
            x.astype(np.float32),
            k,
        )
    runs = {
        label: lambda calls, f=f, a=a, k=k: f(x, y, index_rows[:calls], w.copy(), a, k)
        for label, (f, a, k) in variants.items()
    }
    return alternated_us(runs, 2_000)


def main() -> None:
    output = output_path(__doc__)
    times = model_times(np.random.default_rng(0))
    sgld_step = sgld_block_us()
    force = next(iter(times.values()))
    lines = [
        *header("A GLM's covariance products without writing G (`benchmarks/glm_products.py`)"),
        "",
        f"SGLD's whole step in its compiled block (P1's model, D = 100, n = 500, thin = 10): "
        f"{sgld_step:.2f} µs.",
        "",
        "| model of a step | µs | over SGLD's pass (µs) | SGLD steps, at least |",
        "| --- | --- | --- | --- |",
    ]
    for label, us in times.items():
        extra = us - force
        at_least = (sgld_step + extra) / sgld_step
        lines.append(f"| {label} | {us:.2f} | {extra:.2f} | {at_least:.2f} |")
    write(lines, output)


if __name__ == "__main__":
    main()
