"""Where a covariance sampler's step goes at D = 100, n = 500: kernels timed on their own.

The guide's "Cost per step" section explains why mCCAdL and NOGIN cost more than 1.6x an SGLD
step with the papers' per-step estimate of Sigma. This script measures the pieces behind that
argument, each in a compiled numba loop (the smallest of 25 runs of many calls, the
variants of a table alternated):

1. the product ``Gc^T (Gc w)`` with the 500 x 100 per-observation gradients G, by the project's
   kernel (``gram_product._centred_gram``: float64 rows, and float32 rows summed in float32
   with each entry centred, as the blocks read them since 2026-12-02) and by the
   alternatives tried: eight rows at a time, G stored transposed, two BLAS calls, G stored in
   float32 but summed in float64 (the kernel before 2026-12-02), and everything in float32
   without the centring;
2. the predictor X[idx] @ w of SGLD's fused gather kernel on 500 random rows of data the size
   of P1's (10,000 x 100, 8 MB), against the first 500 rows (400 kB, which the L2 cache
   holds);
3. a model of the per-observation part of a step (predictor, G with its column sums, one
   product). In one variant the rows are first copied out of the data; in the others the loop
   that writes G reads them in place, as PyTensor 3's ``FusedElemwise`` does in the samplers'
   blocks: G in float64 or float32, with or without its column sums of squares (the trace of
   Sigma, which the blocks now compute at the stored steps only), and in a single pass that
   also computes the predictor row by row;
4. conjugate-gradient iterations for NOGIN's system ((1 + l2) I + h^2 Sigma / 4) x = p at
   ``cg_tolerance = 1e-6``, with and without a Jacobi preconditioner, Sigma estimated from
   the minibatch per-observation gradients at P1's posterior mean (20 minibatches each);
5. mCCAdL's compiled block, as ``benchmarks/covariance.py`` times it (D = 100, n = 500,
   h = 1e-3, from the posterior mean, the smallest of 7 fills of 1,000 steps alternated with
   SGLD's), with its Lanczos kernel (``LowRankExpm``) as it is, replaced by exp(0) v = v
   (what the rest of the step costs), and replaced by the 3 products ``Gc^T (Gc w)`` it
   makes there and nothing else (what its bookkeeping costs). Each variant runs in a process
   of its own, since a replaced kernel is registered for the op's type; the table gives each
   process's SGLD time beside it. (NOGIN's step with its solve replaced by a^{-1} v is not
   NOGIN's step less the solve: that chain diverged in a timed fill.)

Run: ``.venv/bin/python benchmarks/product_floor.py [--output
benchmarks/product_floor_results.md]`` (about two minutes on the Intel Xeon).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import single_thread  # noqa: F401  (before NumPy: one thread per runtime)

# isort: split

import numba
import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

from models import GaussianRegression
from report import child_result, header, output_path, write

from pymc_sgmcmc.gather_dot import _gather_matvec
from pymc_sgmcmc.gram_product import _centred_gram, _centred_gram_single, _gram_uncentred_sums

N_OBS, DIM, BATCH = 10_000, 100, 500
ROUNDS, REPEATS = 5, 5


def alternated_us(runs: dict[str, Callable[[int], object]], calls: int) -> dict[str, float]:
    """Time per call of each ``run(calls)``: the smallest of ``ROUNDS`` x ``REPEATS`` runs,
    the variants taking turns round by round, so that a slower spell of this shared machine
    (single runs here vary by 20-30 %) meets every variant."""
    best = dict.fromkeys(runs, np.inf)
    for run in runs.values():
        run(2)  # compile
    for _ in range(ROUNDS):
        for label, run in runs.items():
            for _ in range(REPEATS):
                start = time.perf_counter()
                run(calls)
                best[label] = min(best[label], time.perf_counter() - start)
    return {label: t / calls * 1e6 for label, t in best.items()}


# ---------------------------------------------------------------- 1. the product variants
@numba.njit(fastmath=True)
def gram_eight_rows(g, mean, w, out):
    n, d = g.shape
    c = np.sum(mean * w)
    out[:] = 0
    s = np.empty(8)
    i = 0
    while i + 8 <= n:
        for k in range(8):
            acc = 0.0
            for j in range(d):
                acc += g[i + k, j] * w[j]
            s[k] = acc - c
        for j in range(d):
            acc = 0.0
            for k in range(8):
                acc += g[i + k, j] * s[k]
            out[j] += acc
        i += 8
    while i < n:
        acc = 0.0
        for j in range(d):
            acc += g[i, j] * w[j]
        for j in range(d):
            out[j] += g[i, j] * (acc - c)
        i += 1


@numba.njit(fastmath=True)
def gram_transposed(gt, mean, w, out):
    d, n = gt.shape
    u = np.full(n, -np.sum(mean * w))
    for j in range(d):
        for i in range(n):
            u[i] += gt[j, i] * w[j]
    for j in range(d):
        acc = 0.0
        for i in range(n):
            acc += gt[j, i] * u[i]
        out[j] = acc


@numba.njit
def gram_blas(g, mean, w, out):
    out[:] = (g @ w - mean @ w) @ g


def product_rows(rng) -> list[str]:
    g = rng.standard_normal((BATCH, DIM))
    mean, w = g.mean(0), rng.standard_normal(DIM)
    reference = (g @ w - mean @ w) @ g
    single = g.astype(np.float32)
    variants = [
        ("project kernel, 4 rows at a time (float64)", _gram_uncentred_sums, g, np.float64),
        ("8 rows at a time", gram_eight_rows, g, np.float64),
        ("G stored transposed (D x n)", gram_transposed, np.ascontiguousarray(g.T), np.float64),
        ("two BLAS calls", gram_blas, g, np.float64),
        ("G stored in float32, summed in float64", _gram_uncentred_sums, single, np.float64),
        ("G, m, w and the sums in float32, uncentred", _gram_uncentred_sums, single, np.float32),
        ("project kernel, G in float32: centred sums", _centred_gram_single, single, np.float64),
    ]
    runs, errors = {}, {}
    for label, kernel, matrix, vector_type in variants:

        @numba.njit
        def loop(matrix, mean, w, out, calls, kernel=kernel):
            for _ in range(calls):
                kernel(matrix, mean, w, out)
                w[0] += out[0] * 1e-300  # a dependency between calls

        m, v, out = mean.astype(vector_type), w.astype(vector_type), np.empty(DIM, vector_type)
        kernel(matrix, m, v.copy(), out)
        errors[label] = np.max(np.abs(out - reference)) / np.max(np.abs(reference))
        runs[label] = lambda calls, a=(matrix, m, v, out), f=loop: f(
            a[0], a[1], a[2].copy(), a[3], calls
        )
    times = alternated_us(runs, 10_000)
    return [f"| {label} | {times[label]:.2f} | {errors[label]:.1e} |" for label in runs]


# ---------------------------------------------------------------- 2. reading the rows
@numba.njit
def predictors(x, index_rows, v, out):
    """SGLD's predictor X[idx] @ v for each row of ``index_rows``, by the fused gather
    kernel (``gather_dot._gather_matvec``)."""
    for k in range(index_rows.shape[0]):
        _gather_matvec(x, index_rows[k], v, out)
        v[0] += out[0] * 1e-300  # a dependency between calls


def gather_rows(rng) -> list[str]:
    x, v, out = rng.standard_normal((N_OBS, DIM)), rng.standard_normal(DIM), np.empty(BATCH)
    random_rows = rng.integers(0, N_OBS, (2_000, BATCH))
    in_order = np.tile(np.arange(BATCH), (2_000, 1))
    runs = {
        f"{label} of the 10,000 x 100 data": lambda calls, r=index_rows: predictors(
            x, r[:calls], v, out
        )
        for label, index_rows in (
            ("500 random rows", random_rows),
            ("the first 500 rows", in_order),
        )
    }
    return [f"| {label} | {us:.2f} |" for label, us in alternated_us(runs, 2_000).items()]


# ---------------------------------------------------------------- 3. per-observation part
@numba.njit(fastmath=True)
def residuals(x, y, idx, w):
    r = np.empty(idx.shape[0])
    for i in range(idx.shape[0]):
        row = x[idx[i]]
        s = 0.0
        for j in range(x.shape[1]):
            s += row[j] * w[j]
        r[i] = y[idx[i]] - s
    return r


@numba.njit(fastmath=True)
def gradients_and_product(source, rows, r, w, out, g, squares):
    """G = r * source[rows], written into ``g`` (float64 or float32), with its column sums
    and, with ``squares``, its column sums of squares (the noise covariance's trace), then
    one product with G; returns the product plus the sums of squares (so that nothing is
    optimised away)."""
    s1, s2 = np.zeros(source.shape[1]), np.zeros(source.shape[1])
    for i in range(g.shape[0]):
        row = source[rows[i]]
        for j in range(g.shape[1]):
            v = row[j] * r[i]
            g[i, j] = v
            s1[j] += v
            if squares:
                s2[j] += v * v
    _centred_gram(g, s1 / rows.shape[0], w, out)
    return out + s2


@numba.njit(fastmath=True)
def step_with_copy(x, y, index_rows, w, g, squares):
    acc, out = np.zeros(x.shape[1]), np.empty(x.shape[1])
    for k in range(index_rows.shape[0]):
        idx = index_rows[k]
        r = residuals(x, y, idx, w)
        copied = np.empty((idx.shape[0], x.shape[1]))
        for i in range(idx.shape[0]):
            row = x[idx[i]]
            for j in range(x.shape[1]):  # not copied[i] = row: numba's slice copy is slower
                copied[i, j] = row[j]
        acc += gradients_and_product(copied, np.arange(idx.shape[0]), r, w, out, g, squares)
    return acc


@numba.njit(fastmath=True)
def step_fused(x, y, index_rows, w, g, squares):
    acc, out = np.zeros(x.shape[1]), np.empty(x.shape[1])
    for k in range(index_rows.shape[0]):
        idx = index_rows[k]
        acc += gradients_and_product(x, idx, residuals(x, y, idx, w), w, out, g, squares)
    return acc


@numba.njit(fastmath=True)
def step_one_pass(x, y, index_rows, w, g, squares):
    """The predictor, G and its sums in one pass over the rows (each row's dot product, then
    its gradient while the row is in L1), then one product: what a kernel fusing the gather
    product into the loop that writes G could do at best."""
    acc, out, d = np.zeros(x.shape[1]), np.empty(x.shape[1]), x.shape[1]
    for k in range(index_rows.shape[0]):
        idx = index_rows[k]
        s1, s2 = np.zeros(d), np.zeros(d)
        for i in range(idx.shape[0]):
            row = x[idx[i]]
            z = 0.0
            for j in range(d):
                z += row[j] * w[j]
            r = y[idx[i]] - z
            for j in range(d):
                v = row[j] * r
                g[i, j] = v
                s1[j] += v
                if squares:
                    s2[j] += v * v
        _centred_gram(g, s1 / idx.shape[0], w, out)
        acc += out + s2
    return acc


def per_observation_rows(rng) -> list[str]:
    x, y = rng.standard_normal((N_OBS, DIM)), rng.standard_normal(N_OBS)
    w = 0.1 * rng.standard_normal(DIM)
    index_rows = rng.integers(0, N_OBS, (2_000, BATCH))
    double, single = np.empty((BATCH, DIM)), np.empty((BATCH, DIM), np.float32)
    variants = [
        ("rows copied out of the data, then G", step_with_copy, double, True),
        (
            "rows read in place by the loop that writes G (the blocks before float32 rows)",
            step_fused,
            double,
            True,
        ),
        (
            "the same, G written in float32 (the blocks before the trace moved to the draws)",
            step_fused,
            single,
            True,
        ),
        (
            "the same without the sums of squares (the blocks now: the noise_trace stat is "
            "computed at the stored steps only)",
            step_fused,
            single,
            False,
        ),
        (
            "the same in one pass over the rows (predictor, G and its sums: a kernel of its "
            "own, since PyTensor's fused loop cannot hold a dot product)",
            step_one_pass,
            single,
            False,
        ),
    ]
    first = [step(x, y, index_rows[:3], w, g, sq) for _, step, g, sq in variants[:2]]
    assert np.allclose(*first)
    fused = [step(x, y, index_rows[:3], w, g, sq) for _, step, g, sq in variants[3:]]
    assert np.allclose(*fused)
    runs = {
        label: lambda calls, f=step, g=g, sq=sq: f(x, y, index_rows[:calls], w, g, sq)
        for label, step, g, sq in variants
    }
    return [f"| {label} | {us:.2f} |" for label, us in alternated_us(runs, 2_000).items()]


# ---------------------------------------------------------------- 4. CG iterations
def cg_iterations(a, p, preconditioner=None, tolerance=1e-6, cap=200) -> int:
    x, r = np.zeros_like(p), p.copy()
    z = r if preconditioner is None else r / preconditioner
    d, rz, count = z.copy(), r @ z, 0
    while np.sqrt(r @ r) > tolerance * np.linalg.norm(p) and count < cap:
        ad = a @ d
        count += 1
        step = rz / (d @ ad)
        x += step * d
        r -= step * ad
        z = r if preconditioner is None else r / preconditioner
        rz_new = r @ z
        d, rz = z + rz_new / rz * d, rz_new
    return count


def cg_rows(rng) -> list[str]:
    problem = GaussianRegression.make(n_obs=N_OBS, dim=DIM, batch_size=BATCH, prior_sd=np.sqrt(10))
    gradients = problem.per_observation_gradients(problem.mean)
    rows = []
    for h in (9.07e-4, 1e-3, 5e-3):
        lam2 = np.tanh(h / 2)  # friction 1
        plain, jacobi, conditions = [], [], []
        for _ in range(20):
            rows_ = gradients[rng.integers(0, N_OBS, BATCH)]
            sigma = N_OBS**2 / BATCH * np.cov(rows_.T)  # (N^2 / n) Cov_i g_i
            a = (1 + lam2) * np.eye(DIM) + h**2 / 4 * sigma
            p = rng.standard_normal(DIM)
            plain.append(cg_iterations(a, p))
            jacobi.append(cg_iterations(a, p, np.diag(a)))
            eigenvalues = np.linalg.eigvalsh(a)
            conditions.append(eigenvalues[-1] / eigenvalues[0])
        rows.append(
            f"| {h:g} | {lam2:.1e} | {np.mean(conditions):.2f} | {np.mean(plain):.2f} | "
            f"{np.mean(jacobi):.2f} |"
        )
    return rows


# ---------------------------------------------------------------- 5. the blocks, C step stubbed
#: The Lanczos products of mCCAdL's step at h = 1e-3 from the posterior mean (its
#: expm_products stat: 3.006 on average over 1,000 steps).
LANCZOS_PRODUCTS = 3
STUBS = {
    "as it is": None,
    "replaced by exp(0) v = v": "identity",
    f"replaced by its {LANCZOS_PRODUCTS} products alone": "products",
}


def stub_lanczos_kernel(stub: str) -> None:
    """Register numba code for ``LowRankExpm`` that returns its vector unchanged
    (``stub="identity"``), or first computes ``LANCZOS_PRODUCTS`` products with the
    minibatch's Gram operator, each from the last, and returns the last vector
    (``"products"``)."""
    from pytensor.link.numba.dispatch.basic import register_funcify_default_op_cache_key

    from pymc_sgmcmc.krylov import LowRankExpm

    identity, products = stub == "identity", LANCZOS_PRODUCTS

    @numba.njit
    def expm_stub(g, mean, columns, gain, shift, t, v):
        w, out = v.copy(), np.empty_like(v)
        for _ in range(0 if identity else products):
            _centred_gram(g, mean, w, out)
            for j in range(w.shape[0]):
                w[j] = v[j] + 1e-9 * out[j]  # a new vector each time, near v
        return w, np.asarray(0 if identity else products)

    # A cache key of its own, the same in every process (str hashes are salted).
    salt = int(hashlib.sha256(f"product_floor {stub}".encode()).hexdigest()[:12], 16)
    register_funcify_default_op_cache_key(LowRankExpm)(lambda op, node, **kwargs: (expm_stub, salt))


def block_child(stub: str) -> dict[str, float]:
    """SGLD's and mCCAdL's µs per step in their compiled blocks, ``stub`` ("none",
    "identity" or "products") standing for mCCAdL's Lanczos kernel."""
    import covariance

    if stub != "none":
        stub_lanczos_kernel(stub)
    problem, h = covariance.regression(DIM)
    mean, steps, best = problem.mean, {}, {}
    for name in ("SGLD", "mCCAdL"):
        with problem.model() as model:
            steps[name] = covariance.make(name, h, 1.0, thin=10)
        covariance.prepared_block(problem, steps[name], model)
        best[name] = np.inf
    for _ in range(covariance.COST_REPEATS):
        for name, step in steps.items():
            best[name] = min(best[name], covariance.block_us_per_step(step, mean))
            if step.buffer["diverging"].any():  # a restart's cost is not the step's
                raise RuntimeError(f"{name} diverged in a timed fill (stub {stub})")
    return best


def block_rows() -> list[str]:
    rows = []
    for label, stub in STUBS.items():
        us = child_result([__file__, "--block-child", stub or "none"])
        ratio = us["mCCAdL"] / us["SGLD"]
        rows.append(f"| {label} | {us['mCCAdL']:.1f} | {us['SGLD']:.1f} | {ratio:.2f} |")
    return rows


def main() -> None:
    output = output_path(__doc__)
    rng = np.random.default_rng(0)
    lines = [*header("Pieces of a covariance sampler's step (`benchmarks/product_floor.py`)"), ""]
    lines += [
        "## 1. The product Gc^T (Gc w), G of 500 x 100 (µs per call)",
        "",
        "| variant | µs | largest error / largest entry |",
        "| --- | --- | --- |",
        *product_rows(rng),
        "",
        "## 2. SGLD's predictor X[idx] @ w by the fused gather kernel (µs per minibatch)",
        "",
        "| rows | µs |",
        "| --- | --- |",
        *gather_rows(rng),
        "",
        "## 3. Per-observation part of a step: predictor, G and its sums, one product (µs)",
        "",
        "| variant | µs |",
        "| --- | --- |",
        *per_observation_rows(rng),
        "",
        "## 4. NOGIN's conjugate gradients at cg_tolerance = 1e-6 (P1 at its posterior mean)",
        "",
        "| h | lambda^2 | condition number | iterations | with a Jacobi preconditioner |",
        "| --- | --- | --- | --- | --- |",
        *cg_rows(rng),
        "",
        "## 5. mCCAdL's compiled block with its Lanczos kernel replaced (µs per step, D = 100)",
        "",
        "| Lanczos kernel | mCCAdL µs | SGLD µs (same process) | ratio |",
        "| --- | --- | --- | --- |",
        *block_rows(),
    ]
    write(lines, output)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--block-child"]:  # one variant of section 5, in a process of its own
        print(json.dumps(block_child(sys.argv[2])))
    else:
        main()
