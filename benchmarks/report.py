"""The benchmark tables, generated from benchmarks/results/*.json: one home for how a result reads.

Each benchmark saves its results through `save` (which records the machine, the tested set and the
command, and after a full run rewrites docs/benchmarks.md) and
prints its own section; `docs/benchmarks.md` is this module's output for the last full run of each,
so a figure in the docs is always the one a run wrote.

    ./dev.sh bench-report            # rewrite docs/benchmarks.md from the results files
    ./dev.sh bench-report --check    # exit 1 if docs/benchmarks.md does not match them (the tests run this)
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
# Where --quick runs write (the test suite points it at a folder of its own; git ignores *_quick.json).
QUICK_RESULTS = pathlib.Path(os.environ.get("TORCH_SPLASH_QUICK_RESULTS", RESULTS))
DOC = ROOT / "docs" / "benchmarks.md"
GiB = 2**30


def machine() -> str:
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in _read("/proc/cpuinfo").splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or "unknown CPU",
    )
    return f"{platform.machine()} {model}, {os.cpu_count()} cores, {platform.system()}"


def stack() -> str:
    """The Python and packages a run used: which tested set (locks/) produced it."""
    from torch_splash_jax import compat

    names = ("torch", "torch_xla", "torch-tpu", "jax", "transformers")
    packages = [f"{name} {compat.installed(name)}" for name in names if compat.installed(name)]
    libtpu = pathlib.Path(os.environ.get("TORCH_SPLASH_LIBTPU_DIR", "")).glob("libtpu-*.dist-info")
    packages += [f"libtpu {p.name[len('libtpu-') : -len('.dist-info')]} (TPU compiler)" for p in libtpu]
    return ", ".join([f"Python {compat.python_version()}", *packages])


def _read(path: str) -> str:
    try:
        return pathlib.Path(path).read_text()
    except OSError:
        return ""


def save(name: str, results: dict, quick: bool, command: str) -> pathlib.Path:
    """Write results/<name>.json (or <name>_quick.json), with the machine, date and command, and
    print the section docs/benchmarks.md will show for it."""
    results = {
        **results,
        "machine": machine(),
        "stack": stack(),
        "date": datetime.date.today().isoformat(),
        "command": command + (" --quick" if quick else ""),
    }
    out = QUICK_RESULTS / f"{name}_quick.json" if quick else RESULTS / f"{name}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(SECTIONS[name][2](results))
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    if not quick:  # the doc follows its results, so no other command finds the two out of step
        DOC.write_text(document())
        print(f"wrote {DOC.relative_to(ROOT)}")
    return out


def _bridge(r: dict) -> str:
    lg, sm = r["large"], r["small"]
    ms, us = (lambda s: f"{s * 1e3:.0f} ms"), (lambda s: f"{s * 1e6:.0f} us")
    return "\n".join(
        [
            f"| {lg['shape']} | bridge | direct JAX | ratio (target <= 1.05) | SDPA |",
            "|---|---|---|---|---|",
            f"| forward, no grad | {ms(lg['bridge_fwd'])} | {ms(lg['direct_fwd'])} | {lg['ratio_fwd']:.3f} "
            f"| {ms(lg['sdpa_fwd'])} |",
            f"| forward, inputs requiring grad (vs jax.vjp forward) | {ms(lg['bridge_fwd_train'])} "
            f"| {ms(lg['direct_fwd_train'])} | {lg['ratio_fwd_train']:.3f} | |",
            f"| forward+backward | {ms(lg['bridge_fwd_bwd'])} | {ms(lg['direct_fwd_bwd'])} | {lg['ratio_fwd_bwd']:.3f} "
            f"| {ms(lg['sdpa_fwd_bwd'])} |",
            "",
            f"| {sm['shape']} | bridge | direct JAX | bridge overhead | SDPA | bridge / SDPA |",
            "|---|---|---|---|---|---|",
            f"| forward, no grad | {us(sm['bridge_fwd'])} | {us(sm['direct_fwd'])} "
            f"| {sm['bridge_overhead_fwd_us']:.0f} us | {us(sm['sdpa_fwd'])} | {sm['ratio_to_sdpa_fwd']:.1f}x |",
            f"| forward+backward | {us(sm['bridge_fwd_bwd'])} | {us(sm['direct_fwd_bwd'])} "
            f"| {sm['bridge_overhead_fwd_bwd_us']:.0f} us | {us(sm['sdpa_fwd_bwd'])} "
            f"| {sm['ratio_to_sdpa_fwd_bwd']:.1f}x |",
        ]
    )


def _masks(r: dict) -> str:
    lines = ["| mask | L | torch_splash_jax.tables | JAX _process_mask | speedup |", "|---|---|---|---|---|"]
    for row in r["tables"]:
        jax_s = f"{row['jax_s']:.3f} s" if "jax_s" in row else "not run"
        speed = f"{row['speedup']:.0f}x" if "speedup" in row else ""
        lines.append(f"| {row['mask']} | {row['L'] // 1024}K | {row['ours_s']:.3f} s | {jax_s} | {speed} |")
    if "per_head_tables" in r:
        lines += [
            "",
            "| per-head mask, 4 heads (stored partial blocks) | L | torch_splash_jax.tables | JAX _process_mask "
            "| speedup |",
            "|---|---|---|---|---|",
        ]
        for row in r["per_head_tables"]:
            jax_s = f"{row['jax_s']:.3f} s" if "jax_s" in row else "not run"
            speed = f"{row['speedup']:.0f}x" if "speedup" in row else ""
            lines.append(
                f"| causal, local 1024, causal, chunked 4096 | {row['L'] // 1024}K | {row['ours_s']:.3f} s "
                f"| {jax_s} | {speed} |"
            )
    lines += [
        "",
        "| L | splash LocalMask(1023) forward | SDPA, dense bool mask | splash time / L, relative to 2K |",
        "|---|---|---|---|",
    ]
    base = r["window_1024"][0]["splash_s"] / r["window_1024"][0]["L"]
    for row in r["window_1024"]:
        lines.append(
            f"| {row['L'] // 1024}K | {row['splash_s']:.2f} s | {row['sdpa_dense_s']:.2f} s "
            f"| {row['splash_s'] / row['L'] / base:.2f} |"
        )
    return "\n".join(lines)


def _hf(r: dict) -> str:
    lines = [
        f"| model (training step, median of {r['rounds']} rounds) | L | splash | sdpa | splash / sdpa |",
        "|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        lines.append(
            f"| {row['model']} | {row['length']} | {row['splash_s']:.3f} s | {row['sdpa_s']:.3f} s "
            f"| {row['ratio']:.2f}x |"
        )
    return "\n".join(lines)


def _transports(r: dict) -> str:
    lines = [f"| {r['setting']} | step time | XLA executions per step |", "|---|---|---|"]
    for name in ("graph", "dlpack", "sdpa"):
        lines.append(f"| {name} | {r[name]['step_s'] * 1e3:.0f} ms | {r[name]['executions_per_step']} |")
    return "\n".join(lines)


def _gib(row: dict) -> str:
    if "error" in row:  # the measuring process died (bench_context_parallel.measure)
        return f"not measured: {row['error']}"
    if "refused" in row:
        return "refused by torch_splash" + (" (block tables past SMEM)" if "SMEM" in row["refused"] else "")
    if "compiler_error" in row:
        return "refused by the TPU compiler"
    figure = f"{row['bytes'] / GiB:.2f} GiB"
    if row["fits"]:
        return figure
    single = "a single buffer of " if row.get("lower_bound") else ""
    return f"does not fit ({single}{figure} > {row['capacity'] / GiB:.2f})"


def _tpu_memory(r: dict) -> str:
    shape = r["shape"]
    lines = [
        f"Attention-block training step, B={shape['batch']}, {shape['heads']}/{shape['kv_heads']} heads, "
        f"D={shape['head_dim']}, {shape['dtype']}, {shape['mask']}; libtpu {r['libtpu']}, Mosaic IR "
        f"{r['mosaic_ir_version']}; "
        + (
            "arguments + outputs minus donated + temporaries per chip (the weights updated in place "
            "donated, as torch_xla and torch_splash.fit compile the step)."
            if r.get("donated")
            else "arguments + outputs + temporaries per chip (compiled without buffer donors: the weights "
            "updated in place counted twice)."
        ),
        "",
        "| chip | L | torch_splash | torch SDPA on torch_xla | SDPA / splash |",
        "|---|---|---|---|---|",
    ]
    rows = {(row["generation"], row["L"], row["impl"]): row for row in r["rows"]}
    for generation, length, _ in [key for key in rows if key[2] == "splash"]:
        splash, sdpa = rows[(generation, length, "splash")], rows[(generation, length, "sdpa")]
        ratio = f"{sdpa['bytes'] / splash['bytes']:.0f}x" if splash["fits"] and sdpa["fits"] else ""
        lines.append(f"| {generation} | {length // 1024}K | {_gib(splash)} | {_gib(sdpa)} | {ratio} |")
    for key, length in r["largest"].items():
        generation, name = key.split("/")
        lines.append(f"| {generation} | largest L that fits, {name} | {length // 1024}K | | |")
    return "\n".join(lines)


def _packed_anew(found: dict | None) -> str:
    if found is None:
        return "not measured"
    return f"{found['new_graphs']} of {found['packings']}, {found['build_s']:.2f} s"


def _first_next(row: dict) -> str:
    first, next_ = row.get("compiled_layer_s"), row.get("compiled_next_layer_s")
    return "" if first is None or next_ is None else f"{first:.2f} s / {next_:.2f} s"


def _ratio(value, base: float) -> str:
    return "" if value is None else f"{value:.3f} s ({value / base:.2f}x)"


def _flex(r: dict) -> str:
    shape = r["shape"]
    lines = [
        f"Attention-block training step, B={shape['batch']}, {shape['heads']}/{shape['kv_heads']} heads, "
        f"D={shape['head_dim']}, {shape['dtype']}, {r['mask']}; one v5e chip, libtpu {r['libtpu']}; "
        "arguments + outputs + temporaries. Host: seconds on this machine's CPU.",
        "",
        "| L | blocks of 128 (partial / full / all) | create_block_mask | to splash masks | TPU block tables "
        "| (masks + tables) / create_block_mask | the next layer's masks + tables "
        "| under torch.compile, graph tables + masks + tables: first layer / next | HBM, torch_splash.flex_attention "
        "| HBM, dense bias + SDPA | documents packed anew: graphs not seen before, host seconds per step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        ours = row["to_masks_s"] + row["tables_s"]
        lines.append(
            f"| {row['L'] // 1024}K | {row['partial_blocks']} / {row['full_blocks']} / {row['blocks']} "
            f"| {row['create_block_mask_s']:.2f} s | {row['to_masks_s']:.2f} s | {row['tables_s']:.2f} s "
            f"| {ours / row['create_block_mask_s']:.2f} | {row['next_layer_s'] * 1e3:.0f} ms "
            f"| {_first_next(row)} | {_gib(row['splash'])} "
            f"| {_gib(row['dense'])} | {_packed_anew(row.get('packed_anew'))} |"
        )
    lines += [
        "",
        "CPU (B=1, 4/2 heads, D=64, f32, document-causal), median seconds and the ratio to torch's eager "
        "flex_attention; torch's compiled flex_attention has no backward on the CPU:",
        "",
        "| L | pass | torch eager | torch compiled | torch_splash (interpret-mode kernels) "
        "| torch_splash under torch.compile(fullgraph=True) |",
        "|---|---|---|---|---|---|",
    ]
    for row in r["cpu"]:
        for step in ("forward", "training"):
            base = row[f"{step}_torch_eager"]
            compiled = row.get(f"{step}_torch_compiled")
            lines.append(
                f"| {row['L']} | {'forward' if step == 'forward' else 'forward + backward'} | {base:.3f} s "
                f"| {'' if compiled is None else f'{compiled:.3f} s ({compiled / base:.2f}x)'} "
                f"| {row[f'{step}_splash']:.3f} s ({row[f'{step}_splash'] / base:.2f}x) "
                f"| {_ratio(row.get(f'{step}_splash_compiled'), base)} |"
            )
    return "\n".join(lines)


def _sequence(r: dict) -> str:
    shape = r["shape"]
    lines = [
        f"Forward kernel blocks per device, causal, planned for TPU (B={shape['batch']}, "
        f"{shape['heads']}/{shape['kv_heads']} heads, D={shape['head_dim']}):",
        "",
        "| L | devices | layout | blocks per device (min / max) | max / mean |",
        "|---|---|---|---|---|",
    ]
    for row in r["blocks"]:
        blocks = row["blocks"]
        mean = sum(blocks) / len(blocks)
        lines.append(
            f"| {row['L'] // 1024}K | {row['devices']} | {row['layout']} | {min(blocks)} / {max(blocks)} "
            f"| {max(blocks) / mean:.2f} |"
        )
    lines += [
        "",
        "HBM per device of the attention-block training step (balanced layout when sharded), by mask "
        "(per-head: half the heads causal, half a causal 4096-token window):",
        "",
        "| L | mask | 1 v5e chip (unsharded) | 4 chips (v5e:2x2) | 16 chips (v5e:4x4) |",
        "|---|---|---|---|---|",
    ]
    cells = {(row.get("mask", "causal"), row["chips"], row["L"]): _gib(row) for row in r["tpu_memory"]}
    for mask, length in sorted({(row.get("mask", "causal"), row["L"]) for row in r["tpu_memory"]}):
        lines.append(
            f"| {length // 1024}K | {mask} | "
            + " | ".join(cells.get((mask, chips, length), "not run") for chips in (1, 4, 16))
            + " |"
        )
    step = r["cpu_step"]
    lines += [
        "",
        f"Forward + backward on {step['devices']} CPU devices (B={step['batch']}, {step['heads']}/{step['kv_heads']} "
        f"heads, D={step['head_dim']}, {step['dtype']}, causal, interpret mode):",
        "",
        "| L | layout | step time |",
        "|---|---|---|",
    ]
    for row in step["rows"]:
        lines.append(f"| {row['L']} | {row['layout']} | {row['step_s']:.2f} s |")
    return "\n".join(lines)


def _context_parallel(r: dict) -> str:
    shape = r["shape"]
    rows = r["rows"]
    lines = [
        f"Attention-block training step, B={shape['batch']}, {shape['heads']}/{shape['kv_heads']} heads, "
        f"D={shape['head_dim']}, {shape['dtype']}, {shape['mask']}, {shape['layout']} layout; libtpu {r['libtpu']}. "
        "HBM per chip; the 1/N column is one v5e chip's figure (the compiler's, where it does not fit) divided "
        "by the chips, or (~) the longest one-chip figure scaled linearly to L, where torch_splash refuses one "
        "chip's block tables.",
        "",
        "| L | chips | 1/N of one chip | all_gather | ring | ring / (1/N) | ring permutes overlapping a kernel |",
        "|---|---|---|---|---|---|---|",
    ]
    found = {(row.get("slice"), row.get("strategy"), row.get("L")): row for row in rows}
    one_chip = {row["L"]: row for row in rows if row.get("strategy") == "one_chip" and "bytes" in row}
    slices = [(row["slice"], row["chips"]) for row in rows if row.get("chips", 1) > 1]
    for slice_name, chips in dict.fromkeys(slices):
        for length in sorted({row["L"] for row in rows if row.get("slice") == slice_name and "L" in row}):
            ring = found.get((slice_name, "ring", length))
            gather = found.get((slice_name, "all_gather", length))
            share, approx = _one_chip_share(one_chip, length, chips)
            ratio = f"{ring['bytes'] / share:.2f}" if ring and share and "bytes" in ring else ""
            overlap = (
                f"{ring['overlapping_a_kernel']} of {ring['ring_permutes']}" if ring and "ring_permutes" in ring else ""
            )
            lines.append(
                f"| {_tokens(length)} | {chips} ({slice_name}) | {f'{approx}{share / GiB:.2f} GiB' if share else ''} | "
                f"{_gib(gather) if gather else 'not run'} | {_gib(ring) if ring else 'not run'} | {ratio} | {overlap} |"
            )
    # the longest ring measured to fit on the slice searched (its rows kept when other slices are re-measured)
    searched = [row for row in rows if row.get("slice") == "v5e:4x4" and row.get("strategy") == "ring"]
    longest = max((row for row in searched if row.get("fits")), key=lambda row: row["L"], default=None)
    if longest and len(searched) > 3:  # searched past the fixed lengths
        beyond = [row for row in rows if row.get("slice") == longest["slice"] and row.get("L", 0) > longest["L"]]
        refused = min(beyond, key=lambda row: row["L"]) if beyond else None
        lines.append(
            f"\nThe longest ring that fits on {longest['slice']} (searched up from 4M in 1M, then 256K steps): "
            f"{_tokens(longest['L'])}, {_gib(longest)} per chip"
            + (f"; {_tokens(refused['L'])}: {_gib(refused)}." if refused else ".")
        )
    errors = [row for row in rows if "error" in row]
    for row in errors:
        lines.append(f"\n{row['slice']}: the measuring process failed: {row['error']}")
    return "\n".join(lines)


def _one_chip_share(one_chip: dict, length: int, chips: int) -> tuple[float | None, str]:
    """(the one-chip figure at `length` over `chips`, ""); where one chip has no figure at that
    length (torch_splash refuses its tables), the longest one it has scaled linearly, as splash's
    memory grows ("~")."""
    if length in one_chip:
        return one_chip[length]["bytes"] / chips, ""
    below = [n for n in one_chip if n < length]
    if not below:
        return None, ""
    n = max(below)
    return one_chip[n]["bytes"] * length / n / chips, "~"


def _tokens(length: int) -> str:
    return f"{length / 2**20:g}M" if length % 2**18 == 0 and length >= 2**20 else f"{length // 1024}K"


def _fit(r: dict) -> str:
    lines = [
        f"{r['model']}.",
        "",
        "| attention | L | fits | HBM per chip (GiB) | the compiler's figure when not (GiB) |",
        "|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        total = f"{row['total'] / GiB:.2f}" if row["fits"] else ""
        need = (
            "" if row["fits"] else (row["error"] or f"needs {row['needed'] / GiB:.2f} of {row['capacity'] / GiB:.2f}")
        )
        lines.append(f"| {row['attention']} | {row['L']} | {'yes' if row['fits'] else 'no'} | {total} | {need} |")
    searched = ", ".join(str(n) for n in r["searched"])
    lines += ["", f"Longest splash length that fits on {r['topology']} among those searched ({searched}): "
              f"{r['largest_splash']}."]  # fmt: skip
    return "\n".join(lines)


def _stats(errors: list[float]) -> tuple[str, str]:
    if not errors:
        return "", ""
    median = (
        sorted(abs(e) for e in errors)[len(errors) // 2]
        if len(errors) % 2
        else sum(sorted(abs(e) for e in errors)[len(errors) // 2 - 1 : len(errors) // 2 + 1]) / 2
    )
    return f"{median:.1%}", f"{sum(abs(e) <= 0.25 for e in errors) / len(errors):.0%}"


def _ms(value) -> str:
    return "" if value is None else f"{value:.3f}"


def _decode_cell(part: dict | None, floor: float) -> str:
    if part is None:
        return ""
    if "error" in part:
        return f"refused: {part['error'][:60]}"
    seconds = part["seconds"] if "seconds" in part else part["cycles"]
    return f"{seconds * 1e3:.3f} ({seconds / floor:.2f}x)"


def _decode(r: dict) -> str:
    lines = [
        "Decode steps (one query token per sequence, 32/8 heads, head_dim 128, bf16, the whole cache visible): ms "
        "per call and, in parentheses, times the HBM floor (reading k and v once). decode and splash: the "
        "estimator's time of each program (kernels by their schedule, the XLA ops around them by XLA's estimate); "
        "dense: XLA's own estimate of dense attention in XLA ops (what SDPA lowers to), not a schedule's. Blocks: "
        "the decode plan's kv heads x keys per grid step.",
        "",
        "| chip | cache | B | floor ms | decode | kernel alone | splash | dense (XLA's estimate) | splash / decode "
        "| blocks |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["steps"]:
        floor, decode, splash = row["floor"], row["decode"], row["splash"]
        speedup = f"{splash['seconds'] / decode['seconds']:.1f}x" if "seconds" in splash and "seconds" in decode else ""
        kernel = f"{decode['kernel'] / floor:.2f}x" if "kernel" in decode else ""
        blocks = f"{row['blocks']['heads']} x {row['blocks']['kv']}"
        lines.append(
            f"| {row['generation']} | {_tokens(row['kv_len'])} | {row['batch']} | {floor * 1e3:.3f} | "
            f"{_decode_cell(decode, floor)} | {kernel} | {_decode_cell(splash, floor)} | "
            f"{_decode_cell(row.get('dense'), floor)} | {speedup} | {blocks} |"
        )
    lines += [
        "",
        "Chunked prefill: new tokens against a 32K cache, B=1, 32/8 heads (rows per kv head: 4 x tokens). ms per "
        "call and times the HBM floor; the default rule sends calls of up to `AUTO_MAX_ROWS` rows to the decode "
        "kernel.",
        "",
        "| chip | new tokens | rows | decode | splash | splash / decode |",
        "|---|---|---|---|---|---|",
    ]
    for row in r["chunks"]:
        floor, decode, splash = row["floor"], row["decode"], row["splash"]
        speedup = f"{splash['seconds'] / decode['seconds']:.2f}x" if "seconds" in splash and "seconds" in decode else ""
        lines.append(
            f"| {row['generation']} | {row['q_len']} | {4 * row['q_len']} | {_decode_cell(decode, floor)} | "
            f"{_decode_cell(splash, floor)} | {speedup} |"
        )
    return "\n".join(lines)


def _hf_decode(r: dict) -> str:
    lines = [
        "Milliseconds per decode step and, in parentheses, times the HBM floor (reading the layer's k and v "
        "caches once); splash: the attention kernels' estimate plus XLA's estimate of the rest; HBM: the step's "
        "per device, the cache (donated) counted once.",
        "",
        "| chip | cache | B | floor ms | sdpa | splash | sdpa / splash | HBM sdpa GiB | HBM splash GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        floor, sdpa, splash = row["floor"], row["sdpa"], row["splash"]
        speedup = f"{sdpa['seconds'] / splash['seconds']:.2f}x" if "seconds" in sdpa and "seconds" in splash else ""
        hbm = [f"{part['hbm'] / (1 << 30):.2f}" if "hbm" in part else "" for part in (sdpa, splash)]
        lines.append(
            f"| {row['generation']} | {_tokens(row['cache'])} | {row['batch']} | {floor * 1e3:.3f} | "
            f"{_decode_cell(sdpa, floor)} | {_decode_cell(splash, floor)} | {speedup} | {hbm[0]} | {hbm[1]} |"
        )
    return "\n".join(lines)


def _memory(r: dict) -> str:
    lines = [
        f"Program cache of {r['cache']}, {r['shapes']} shapes. Per new shape: RSS (MB) and live jaxprs while the cache "
        f"fills (shapes {r['cache'] // 2} to {r['cache']}) and after it has turned over twice (shapes {2 * r['cache']} "
        f"to {r['shapes']}).",
        "",
        "| kernel called | MB while filling | MB after | after / filling (target < 0.10) | jaxprs while filling "
        "| jaxprs after |",
        "|---|---|---|---|---|---|",
    ]
    names = {"programs": "traced into each program (torch_splash)", "baseline": "through its own jax.jit (baseline)"}
    for key, name in names.items():
        m = r[key]
        lines.append(
            f"| {name} | {m['filling_mb']:.2f} | {m['after_mb']:.2f} | {m['after_mb'] / m['filling_mb']:.3f} "
            f"| {m['filling_jaxprs']:.1f} | {m['after_jaxprs']:.1f} |"
        )
    return "\n".join(lines)


def _tpu_time_comparison(rows: list) -> list[str]:
    lines = [
        "",
        "Side by side, one device, B=1, bf16: estimated kernel time per call of a training step in ms (MXU: useful "
        "flops over that time at the chip's peak): the forward (with residuals, as a step runs it) and forward + "
        "backward. MaxText: JAX's splash at MaxText's defaults (512 blocks, separate dq and dkv kernels; also "
        "torch_splash's TPU plan before the search below chose it). planned: JAX's splash kernels at "
        "torch_splash's TPU plan's blocks (forward q x kv, then the fused dkv kernel's, or dkv and dq). "
        "tokamax: its forward at the configuration "
        "its cache measured for the shape, measured time in brackets; where it measured none at that length, at "
        'the configuration it measured for the nearest one ("from 16K"; "from B=32, 4K" where it measured those '
        'heads at B=32 only; "from 16/16 heads, 16K" where it measured them not at all); v5e, for which tokamax '
        "caches nothing, at the configuration it measured on v5p. "
        "For windows and segment ids, what tokamax's TPU op (0.0.17) does with them. Document: causal with segment "
        "ids. Where "
        "JAX's forward is slower than tokamax's, the row names the unit its schedule keeps busiest (docs/tpu_time.md): "
        "where that is not the MXU, JAX's kernel spends its bundles on the softmax's elementwise work (VALU) or on "
        "writing its blocks (store) rather than on matrix multiplies. active: the project's own active-block "
        "kernels (torch_splash's default where they serve the call; docs/tpu.md), each forward with its binding "
        "unit; blank where a row predates them.",
        "",
        "| chip | mask | L | heads | D | MaxText fwd | MaxText fwd+bwd | planned | planned fwd | planned fwd+bwd "
        "| planned / MaxText (fwd+bwd) | tokamax fwd | planned / tokamax (fwd) | active fwd | active fwd+bwd "
        "| active / tokamax (fwd) | active / planned (fwd+bwd) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ranges = {}  # generation: the active forward over tokamax's, each row it serves
    for row in rows:
        maxtext, planned, tk = row.get("maxtext", {}), row["planned"], row.get("tokamax")
        active = row.get("active", {})

        def cell(part, key):
            if "error" in part:
                return "refused: " + part["error"].split(":")[0]
            return f"{part[key + '_ms']:.3f} ({part[key + '_mxu']:.0%})" if key + "_ms" in part else ""

        b = planned["blocks"]
        kernels = f"{b['block_q']}x{b['block_kv']}, " + (
            f"fused {b['block_q_dkv']}x{b['block_kv_dkv']}"
            if b["use_fused_bwd_kernel"]
            else f"dkv {b['block_q_dkv']}x{b['block_kv_dkv']}, dq {b['block_q_dq']}x{b['block_kv_dq']}"
        )
        ratio = (
            f"{planned['step_ms'] / maxtext['step_ms']:.2f}" if "step_ms" in planned and "step_ms" in maxtext else ""
        )
        tk_cell = tk_ratio = ""
        if tk and "refused" in tk:
            tk_cell = tk["refused"]
        elif tk:
            cache, layout = tk.get("cache", row["generation"]), f"{row['heads']}/{row['kv_heads']}"
            heads, batch = tk.get("cached_heads", layout), tk.get("cached_batch", 1)
            origin = [f"{cache}'s configuration"] if cache != row["generation"] else []
            measured_as = ([f"{heads} heads"] if heads != layout else []) + ([f"B={batch}"] if batch != 1 else [])
            if measured_as or tk["cached_at"] != row["L"]:
                origin.append("from " + ", ".join([*measured_as, f"{tk['cached_at'] // 1024}K"]))
            where = f"[{tk['measured_ms']:.3f}]" if tk["measured_ms"] else f"({', '.join(origin)})"
            tk_cell = f"{tk['forward_ms']:.3f} {where} at {tk['blocks']}"
            if "forward_ms" in planned:
                ratio_tk = planned["forward_ms"] / tk["forward_ms"]
                held = f" (JAX's forward: {planned['binding']['forward']}-bound)" if ratio_tk > 1.0 else ""
                tk_ratio = f"{ratio_tk:.2f}{held}"
        active_fwd = cell(active, "forward")
        if "forward_ms" in active:
            active_fwd += f", {active['binding']['forward']}"
        active_tk = ""
        if tk and "forward_ms" in tk and "forward_ms" in active:
            ranges.setdefault(row["generation"], []).append(active["forward_ms"] / tk["forward_ms"])
            active_tk = f"{ranges[row['generation']][-1]:.2f}"
        active_ratio = (
            f"{active['step_ms'] / planned['step_ms']:.2f}" if "step_ms" in active and "step_ms" in planned else ""
        )
        lines.append(
            f"| {row['generation']} | {row['mask']} | {row['L'] // 1024}K | {row['heads']}/{row['kv_heads']} "
            f"| {row['head_dim']} | {cell(maxtext, 'forward')} | {cell(maxtext, 'step')} | {kernels} "
            f"| {cell(planned, 'forward')} | {cell(planned, 'step')} | {ratio} | {tk_cell} | {tk_ratio} "
            f"| {active_fwd} | {cell(active, 'step')} | {active_tk} | {active_ratio} |"
        )
    if ranges:
        lines += [
            "",
            "The active forward against tokamax's, over the rows tokamax serves: "
            + "; ".join(f"{g} {min(v):.2f}x to {max(v):.2f}x" for g, v in ranges.items())
            + ".",
        ]
    return lines + _tpu_time_against_vjp(rows)


def _tpu_time_against_vjp(rows: list) -> list[str]:
    """Forward + backward against tokamax's, where its cache measured both its forward and its vjp
    op at the row's very shape."""
    both = [r for r in rows if (r.get("tokamax") or {}).get("vjp_measured_ms") and "step_ms" in r.get("active", {})]
    if not both:
        return []
    lines = [
        "",
        "Forward + backward against tokamax's measured forward plus its measured vjp op, where its cache "
        "measured both at the row's shape (the vjp op's time holds the XLA ops around its kernel, the "
        "transposes into its layout and back; the active kernels' estimate is the kernels alone):",
        "",
        "| chip | mask | L | heads | D | tokamax fwd + vjp, measured ms | active fwd+bwd, estimated ms "
        "| active / tokamax |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in both:
        tk, active = r["tokamax"], r["active"]
        total = tk["measured_ms"] + tk["vjp_measured_ms"]
        lines.append(
            f"| {r['generation']} | {r['mask']} | {r['L'] // 1024}K | {r['heads']}/{r['kv_heads']} | {r['head_dim']} "
            f"| {tk['measured_ms']:.3f} + {tk['vjp_measured_ms']:.3f} = {total:.3f} | {active['step_ms']:.3f} "
            f"| {active['step_ms'] / total:.2f} |"
        )
    return lines


def _blocks(b: dict) -> str:
    """Planned blocks in the search's own terms: forward q x kv / compute, then the backward's."""
    text = f"{b['block_q']}x{b['block_kv']}/{b['block_kv_compute']}, dkv {b['block_q_dkv']}x{b['block_kv_dkv']}"
    text += f"/{b['block_kv_dkv_compute']}"
    return text + (" fused" if b["use_fused_bwd_kernel"] else f", dq {b['block_q_dq']}x{b['block_kv_dq']}")


def _tpu_time_search(rows: list) -> list[str]:
    from torch_splash_jax.block_planning import dq_buffer_fits
    from torch_splash_jax.kernel_limits import FUSED_DQ_BUFFER_BYTES

    names = [n for n in rows[0]["ms"] if n != "planned"]  # every row runs the same candidates
    lines = [
        "",
        "Search: estimated forward+backward kernel time (ms) of each candidate TPU plan and of torch_splash's plan, "
        "causal, B=1, 16 heads, bf16 (blocks: forward q x kv / compute; the dkv and dq kernels' as in "
        "bench_tpu_time.CANDIDATES); a fused candidate's time is followed by its dq buffer, in q's, in braces "
        "(16 q's are 2 GiB at 32K tokens, and at 16K with head_dim 256). The plan fuses the backward only while "
        "that buffer is at most 8 q's or "
        f"{FUSED_DQ_BUFFER_BYTES / 2**30:g} GiB, whichever allows more (its bound). Estimated "
        f"{'with' if rows[0].get('calibrated') else 'before'} the fitted numbers.",
        "",
        "| chip | L | D | "
        + " | ".join(names)
        + " | planned | planned / fastest | planned / fastest within its bound |",
        "|---|---|---|" + "---|" * (len(names) + 3),
    ]
    for row in rows:
        ms, buffers = row["ms"], row.get("dq_buffer", {})
        timed = {k: v for k, v in ms.items() if isinstance(v, float) and k != "planned"}
        q_row_bytes = 16 * row["head_dim"] * 2
        bounded = {k: v for k, v in timed.items() if dq_buffer_fits(buffers.get(k, 0), row["L"], q_row_bytes)}
        cells = [
            (f"{ms[n]:.2f}" + (f" {{{buffers[n]}}}" if n in buffers else "")) if isinstance(ms[n], float) else "refused"
            for n in names
        ]
        planned = ms.get("planned")
        as_name = f" (= {row['planned_as']})" if row.get("planned_as") else f" ({_blocks(row['blocks']['planned'])})"
        fastest = [f"{planned / min(d.values()):.2f} ({min(d, key=d.get)})" if d and isinstance(planned, float) else ""
                   for d in (timed, bounded)]  # fmt: skip
        head = f"| {row['generation']} | {row['L'] // 1024}K | {row['head_dim']} | {' | '.join(cells)} "
        if isinstance(planned, float):
            lines.append(head + f"| {planned:.2f}{as_name} | {' | '.join(fastest)} |")
        else:
            lines.append(head + "| refused | | |")
    return lines


def _tpu_time(r: dict) -> str:
    stall, factors = r["row_stall_us"] * 1e-3, r["clock_factor"]  # ms per row
    fitted = r["fitted"]
    lines = [
        f"libtpu {r['libtpu']}. Error = estimate / measured - 1 over tokamax's measured entries (bf16, each at "
        f"its winning configuration). The fitted numbers in the code (torch_splash_jax.tpu_time): a stall of "
        f"{r['row_stall_us']:.3f} us per row for every generation, and per generation the clock factor below; this "
        f"run fits {fitted['row_stall_us']:.3f} us and "
        + ", ".join(f"{g} {f:.3f}" for g, f in fitted["clock_factor"].items())
        + " (the backward is estimated with the forward's numbers, not fitted, and adds the HBM traffic of the XLA "
        "ops tokamax's vjp op runs around its kernel: torch_splash_jax.tpu_time.calibration.Calibrated.parts).",
        "",
        "| chip, direction | entries | without the fitted numbers: median error | within 25% | clock factor "
        "| with them: median error | within 25% |",
        "|---|---|---|---|---|---|---|",
    ]
    tables = []
    for key, entries in r["calibration"].items():
        generation, direction = key.split("/")
        estimated = [e for e in entries if e.get("schedule_ms") is not None]
        factor = factors.get(generation, 1.0)

        def estimate(e, factor=factor):
            return e["schedule_ms"] * factor + e["hbm_ms"] + e["rows"] * stall

        raw = [(e["schedule_ms"] + e["hbm_ms"]) / e["measured_ms"] - 1 for e in estimated]
        fixed = [estimate(e) / e["measured_ms"] - 1 for e in estimated]
        lines.append(
            f"| {generation} {direction} | {len(estimated)} of {len(entries)} | {' | '.join(_stats(raw))} "
            f"| {factor:.3f} | {' | '.join(_stats(fixed))} |"
        )
        tables += ["", f"{generation} {direction}:", "", "| entry | measured ms | estimate ms | without the fitted "
                   "numbers | error |", "|---|---|---|---|---|"]  # fmt: skip
        for e in entries:
            if e.get("schedule_ms") is None:
                tables.append(f"| {e['entry']} | {e['measured_ms']:.3f} | not estimated: {e['error']} | | |")
                continue
            tables.append(
                f"| {e['entry']} | {e['measured_ms']:.3f} | {estimate(e):.3f} | {e['schedule_ms'] + e['hbm_ms']:.3f} "
                f"| {estimate(e) / e['measured_ms'] - 1:+.0%} |"
            )
    lines += _tpu_time_comparison(r["comparison"])
    lines += [line for note in r.get("notes", ()) for line in ("", note)]
    if r.get("search"):
        lines += _tpu_time_search(r["search"])
    return "\n".join(lines + tables)


def _pct(value: float | None) -> str:
    return "" if value is None else f"{value:+.0%}"


def _chip_estimates(r: dict) -> dict:
    """{(row name, program): (estimate ms at the current clock factor, measured ms)} of a tpu_check
    results file, from the estimates the estimator's libtpu made of its programs."""
    from torch_splash_jax.tpu_time import CLOCK_FACTOR, real_chip

    factor = CLOCK_FACTOR.get(r["chip"].get("generation"), 1.0)
    return {(m.name, m.program): (1e3 * m.estimate(factor), 1e3 * m.measured) for m in real_chip.measured_rows(r)}


PLAN_BLOCKS = "JAX splash, the plan's blocks"


def _tpu_check(r: dict) -> str:
    from torch_splash_jax.tpu_check.cases import by_name, forward_flops

    limits, calls = r.get("limits", {}), by_name()
    rate = limits.get("matmul_tflop_s", 0.0) * 1e12
    read = limits.get("hbm_read_gb_s", 0.0) * 1e9
    passed = [f for f in r["fidelity"] if f.get("passed")]
    worst = max((max(f["errors"].values()) for f in passed), default=float("nan"))
    lines = [
        f"The chip: {r['chip']['device_kind']}, its own limits measured in the same run: HBM read "
        f"{limits.get('hbm_read_gb_s', 0):.0f} GB/s (the sum of a 1 GiB bfloat16 array), bfloat16 matmul "
        f"{limits.get('matmul_tflop_s', 0):.0f} TFLOP/s (8192^3).",
        "",
        f"Fidelity: {len(passed)} of {len(r['fidelity'])} cases within {r['tolerance']:.0%} (relative max error of "
        f"the output and every gradient against a float32 reference at `highest` precision; worst {worst:.2%}). "
        "Every mask family, stored and per-head masks, segment ids, soft cap, sinks, GQA and MQA, head_dim 64 to "
        "256, Dv != D, float32 and float16, lengths off the 128 grid, cross lengths, the batch as heads and one call "
        "per batch element, the decode kernel:",
        "",
        "| case | kernel | dtype | worst error | |",
        "|---|---|---|---|---|",
    ]
    for f in r["fidelity"]:
        error = f"{max(f['errors'].values()):.2%}" if f.get("errors") else f.get("error", "")
        lines.append(f"| {f['name']} | {f.get('kernel', '')} | {f.get('dtype', '')} | {error} | "
                     f"{'ok' if f.get('passed') else 'FAILED'} |")  # fmt: skip
    lines += [
        "",
        'Training calls, bfloat16, forward / forward+backward (a step) in ms. "the plan" is the plan with '
        "`BlockSizes(forward_kernel=\"splash\")`: JAX's splash kernels at the plan's blocks, called as "
        "torch_splash calls them (the batch as heads, or a call per element). JAX's splash is "
        "`make_splash_mha` vmapped over the batch, as MaxText runs it, at MaxText's 512 blocks; "
        "\"the plan's blocks\" runs it at this plan's blocks (vmapped: where the batch's accumulators "
        "overran VMEM, it did not compile). MXU: the forward's matmul flops over its time and the chip's "
        "measured matmul rate. The estimate is `torch_splash_jax.tpu_time`'s (libtpu named below), from the "
        "compiler's schedule without a TPU: the forward kernel, and the step's kernels (without the XLA ops around "
        "them: below); its error is estimate / measured - 1. The active kernels are the plan with "
        '`BlockSizes(forward_kernel="active")`: the project\'s own forward and backward '
        "(`torch_splash_jax.active_kernels`), torch_splash's default where they serve the call; "
        '"active forward" is the same forward with JAX\'s backward '
        '(`backward_kernel="splash"`); blank where they do not serve the call. "Other scheduler": the active '
        "kernels with the TPU compiler's other scheduler than the generation's (`Plan.scheduler`: its default or "
        'LP, `block_planning.LP_SCHEDULER`), and their time over the generation\'s choice; "other logits": '
        "with their forward's logits laid out the other way (`Plan.forward_logits`: by rows or transposed, "
        '`block_planning.TRANSPOSED_LOGITS`), likewise; "other q blocks": with their forward\'s other longest q '
        "block (`Plan.active_block_q`: 2048 or 4096 rows, `block_planning.LONG_BLOCK_Q`; blank where the blocks "
        "come out the same), likewise.",
        "",
        "| call | the plan | batch as heads vs a call per element (step) | JAX splash, MaxText blocks "
        "| plan / JAX (step) | JAX splash, the plan's blocks | XLA dense | MXU (forward) | estimate | error "
        "| active forward | active kernels | active / plan (forward / step) | MXU (active forward) "
        "| other scheduler (its / the generation's) | other logits (its / the generation's) "
        "| other q blocks (its / the generation's) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    estimates = _chip_estimates(r)

    def estimated(name: str, *programs: str) -> tuple[str, str]:
        found = [estimates.get((name, p)) for p in programs]
        if not all(found):
            return "", ""
        return " / ".join(f"{e:.2f}" for e, _ in found), " / ".join(_pct(e / m - 1) for e, m in found)

    def pair(measured: dict) -> str:
        if not measured:
            return ""
        if "error" in measured:
            return "does not compile" if "Vmem" in measured["error"] or "vmem" in measured["error"] else "error"
        return " / ".join(f"{measured[k]:.2f}" for k in ("forward_ms", "step_ms") if k in measured)

    for row in [t for t in r["timing"] if t.get("kernel") != "decode"]:
        v, call = row["variants"], calls.get(row["name"])
        plan, maxtext = v.get("plan", {}), v.get("JAX splash, MaxText blocks", {})
        loop = v.get("plan, a call per batch element", {})
        layout = f"{plan['step_ms']:.2f} vs {loop['step_ms']:.2f}" if "step_ms" in loop else ""
        ratio = f"{plan['step_ms'] / maxtext['step_ms']:.2f}x" if "step_ms" in maxtext and "step_ms" in plan else ""
        flops = forward_flops(call) if call else None
        mxu = f"{flops / (plan['forward_ms'] * 1e-3) / rate:.0%}" if flops and rate and "forward_ms" in plan else ""
        shown, errors = estimated(row["name"], "forward", "step")
        active, both = v.get("plan, active forward", {}), v.get("plan, active kernels", {})
        faster, active_mxu = "", ""
        if "forward_ms" in both and "forward_ms" in plan:
            faster = " / ".join(
                f"{both[k] / plan[k]:.2f}x" for k in ("forward_ms", "step_ms") if k in both and k in plan
            )
            active_mxu = f"{flops / (both['forward_ms'] * 1e-3) / rate:.0%}" if flops and rate else ""
        others = []
        for name in ("scheduler", "logits", "q blocks"):
            other = v.get(f"plan, active kernels, other {name}", {})
            keys = [k for k in ("forward_ms", "step_ms") if k in other and k in both]
            versus = " / ".join(f"{other[k] / both[k]:.2f}x" for k in keys)
            others.append(f"{pair(other)}{f' ({versus})' if versus else ''}")
        lines.append(
            f"| {row['name']} | {pair(plan)} | {layout} | {pair(maxtext)} | {ratio} | "
            f"{pair(v.get(PLAN_BLOCKS, {}))} | {pair(v.get('XLA dense', {}))} | {mxu} | "
            f"{shown} | {errors} | {pair(active)} | {pair(both)} | {faster} | {active_mxu} | "
            f"{' | '.join(others)} |"
        )
    lines += [
        "",
        "Decode (one token against a cache) and chunked prefill (B=1, against a 32K cache), ms. The HBM floor "
        "reads k and v once at the chip's measured rate; paged attention and ragged paged attention are JAX's "
        "kernels on the same cache as pages of 128 tokens (32 and 16 pages a block; ragged: 64 MiB of VMEM); "
        "the splash forward is the same call through the splash kernels.",
        "",
        "| call | decode kernel | / HBM floor | paged attention | ragged paged attention | XLA dense | splash forward "
        "| estimate | error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in [t for t in r["timing"] if t.get("kernel") == "decode"]:
        v, call = row["variants"], calls.get(row["name"])
        plan = v.get("plan", {}).get("forward_ms")
        floor = None
        if call and read:
            floor = call.batch * call.kv_heads * call.kv_len * (call.head_dim + call.dv) * 2 / read * 1e3
        guess, error = estimated(row["name"], "decode")

        def ms(name, v=v):
            return f"{v[name]['forward_ms']:.3f}" if "forward_ms" in v.get(name, {}) else ""

        lines.append(
            f"| {row['name']} | {ms('plan')} | {f'{plan / floor:.2f}x' if plan and floor else ''} | "
            f"{ms('paged attention')} | {ms('ragged paged attention')} | {ms('XLA dense')} | {ms('splash forward')} | "
            f"{guess} | {error} |"
        )
    lines += _real_chip_calibration(r)
    lines += [f"- {note}" for note in r.get("notes", [])]
    return "\n".join(lines)


def _real_chip_calibration(r: dict) -> list[str]:
    from torch_splash_jax.tpu_time import CLOCK_FACTOR, ESTIMATOR_LIBTPU, real_chip

    rows = real_chip.measured_rows(r)
    if not rows:
        return []
    generation = r["chip"].get("generation")
    factor = CLOCK_FACTOR.get(generation, 1.0)

    def spread(program, with_rest=False):
        errs = real_chip.errors(rows, factor, program, with_rest)
        return f"median {_pct(sorted(errs)[len(errs) // 2])}, {min(errs):+.0%} to {max(errs):+.0%}"

    every_run = real_chip.all_measured_rows(r)
    runs = 1 + len(r.get("earlier_runs", []))
    return [
        "",
        f"The estimates: libtpu {ESTIMATOR_LIBTPU}'s schedules (the estimator's), at {generation}'s clock factor "
        f"{factor:.4f}, which the forwards of this run and the earlier ones on the chip fit "
        f"(torch_splash_jax.tpu_time.real_chip: tokamax measured no v5e attention; {runs} runs, "
        f"{sum(m.program == 'forward' for m in every_run)} forwards: the fit gives "
        f"{real_chip.fitted_factor(every_run):.4f}; this run's alone {real_chip.fitted_factor(rows):.4f}). "
        "This run's forward kernels against the measured "
        f"forward: {spread('forward')}; the step's kernels against the measured step (which also runs the XLA ops "
        f"around them): {spread('step')}; adding XLA's own estimate of those ops: {spread('step', True)}, so XLA's "
        f"estimate overshoots them. Decode and prefill, bound by HBM, where the estimate adds schedule and HBM time: "
        f"{spread('decode')}.",
    ]


def _active_kernels(r: dict) -> str:
    from torch_splash_jax.tpu_check.cases import by_name, forward_flops
    from torch_splash_jax.tpu_time.chips import chip as generation_chip

    calls, measured = by_name(), {}
    chip_file = RESULTS / "tpu_check_v5e.json"
    if chip_file.exists():  # the same calls measured on the lent v5e: the estimates' error there
        for row in json.loads(chip_file.read_text())["timing"]:
            v = row["variants"]
            plan, active = v.get("plan", {}), v.get("plan, active kernels", {})
            measured[row["name"]] = {
                ("plan", "forward"): plan.get("forward_ms"),
                ("active", "forward"): active.get("forward_ms"),
                ("plan", "backward"): plan["step_ms"] - plan["forward_ms"] if "step_ms" in plan else None,
                ("active", "backward"): active["step_ms"] - active["forward_ms"] if "step_ms" in active else None,
            }
    generations = sorted({row["generation"] for row in r["rows"]}, key=["v5e", "v5p", "v6e", "v7x"].index)
    rows = {(row["name"], row["generation"]): row for row in r["rows"]}
    lines = []
    for part, what in (
        ("forward", "Forward kernel"),
        ("backward", "Backward kernels (JAX's dq and dkv, or the one active backward)"),
    ):
        lines += [
            f"{what}, estimated ms: the plan's JAX splash / the active-block kernels (their ratio; the active "
            "kernels' MXU use, their matmul flops over their time at the generation's peak; their binding unit, by "
            "the estimate; † a kernel's code outgrows one instruction overlay). On v5e, the estimate's error "
            "against the chip's measured time (tpu_check's run; the backward measured as step minus forward, which "
            "also holds the XLA ops around the kernels), plan / active.",
            "",
            "| call | " + " | ".join(generations) + " | v5e error, plan / active |",
            "|---|" + "---|" * (len(generations) + 1),
        ]
        for name in dict.fromkeys(row["name"] for row in r["rows"]):
            cells = []
            for generation in generations:
                row = rows.get((name, generation), {})
                plan, active = row.get("plan", {}).get(part, {}), row.get("active", {}).get(part, {})
                if "seconds" not in plan or "seconds" not in active:
                    found = row.get("plan", {}).get("error") or row.get("active", {}).get("error") or ""
                    cells.append(found[:60])
                    continue
                share = active["mxu"]
                if part == "forward" and name in calls and forward_flops(calls[name]):
                    share = forward_flops(calls[name]) / active["seconds"] / generation_chip(generation).peak_flops
                mxu = f"{share:.0%}, "
                outgrown = [_outgrown(x) for x in (plan, active)]
                cells.append(
                    f"{plan['seconds'] * 1e3:.2f}{outgrown[0]} / {active['seconds'] * 1e3:.2f}{outgrown[1]} "
                    f"({active['seconds'] / plan['seconds']:.2f}x; {mxu}{active['binding_unit']})"
                )
            error = ""
            on_chip, v5e = measured.get(name, {}), rows.get((name, "v5e"), {})
            if all(on_chip.get((k, part)) and "seconds" in v5e.get(k, {}).get(part, {}) for k in ("plan", "active")):
                error = " / ".join(
                    _pct(v5e[k][part]["seconds"] * 1e3 / on_chip[(k, part)] - 1) for k in ("plan", "active")
                )
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {error} |")
        lines.append("")
    lines += [line for choice in CHOICE_TABLES for line in _choice_table(r, rows, *choice)]
    lines += [line for note in r.get("notes", ()) for line in (note, "")]
    return "\n".join(lines[:-1])


# The per-generation choices bench-active-kernels estimates both ways: (the variant estimated with
# the other value, the field of the active kernels' results, its two values, the table's title).
CHOICE_TABLES = (
    (
        "other sums",
        "row_sums",
        ("vector", "mxu"),
        "Row sums: the active forward's rows summed on the vector unit / in the MXU (`Plan.row_sums`), estimated "
        "ms (their ratio; the step's ratio); * the generation's choice (`block_planning.SUMS_ON_MXU`).",
    ),
    (
        "other logits",
        "forward_logits",
        ("rows", "transposed"),
        "Logits: the active forward's logits laid out by rows / transposed (`Plan.forward_logits`; transposed, its "
        "rows summed on the vector unit), estimated ms (their ratio; the step's ratio); * the generation's choice "
        "(`block_planning.TRANSPOSED_LOGITS`).",
    ),
    (
        "other scheduler",
        "scheduler",
        ("default", "lp"),
        "Scheduler: the active kernels scheduled by the TPU compiler's default / LP scheduler (`Plan.scheduler`), "
        "estimated ms of the forward (their ratio; the step's ratio); * the generation's choice "
        "(`block_planning.LP_SCHEDULER`).",
    ),
    (
        "other key blocks",
        "active_block_kv",
        (1024, 2048),
        "Key blocks: the active kernels with keys in blocks of at most 1024 / 2048 (`Plan.active_block_kv`, at "
        "head_dim above 128), estimated ms of the forward (their ratio; the step's ratio); * the generation's choice "
        "(`block_planning.WIDE_HEADS_BLOCK_KV`); † a kernel's code outgrows one instruction overlay "
        "(`tpu_time.KernelTime.fits_overlay`), where the chip runs slower than the estimate says.",
    ),
    (
        "other q blocks",
        "active_block_q",
        (2048, 4096),
        "Query blocks: the active forward with q blocks of at most 2048 / 4096 rows (`Plan.active_block_q`; at 4096 "
        "its partial blocks in 1024-row tiles), estimated ms of the forward (their ratio; the step's ratio); * the "
        "generation's choice (`block_planning.LONG_BLOCK_Q`); † a kernel's code outgrows one instruction overlay.",
    ),
)


def _outgrown(*parts: dict) -> str:
    """† where a kernel of these parts (forward, backward) outgrows one instruction overlay (results
    from before say nothing)."""
    return "" if all(part.get("fits_overlay", True) for part in parts) else "†"


def _choice_table(r: dict, rows: dict, variant: str, field: str, values: tuple, title: str) -> list[str]:
    """The active kernels at each of a per-generation choice's two values (the plan's and `variant`'s),
    by generation, where both were estimated."""
    order = ["v5e", "v5p", "v6e", "v7x"]
    generations = sorted({g for (_, g), row in rows.items() if variant in row}, key=order.index)
    if not generations:
        return []
    lines = [title, "", "| call | " + " | ".join(generations) + " |", "|---|" + "---|" * len(generations)]
    first, second = values
    for name in dict.fromkeys(row["name"] for row in r["rows"]):
        cells = []
        for generation in generations:
            row = rows.get((name, generation), {})
            both = {x.get(field): x for x in (row.get("active", {}), row.get(variant, {}))}
            a, b = both.get(first, {}), both.get(second, {})
            if "forward" not in a or "forward" not in b:
                cells.append("")
                continue
            step = [sum(x[p]["seconds"] for p in ("forward", "backward")) for x in (a, b)]
            fa, fb = a["forward"]["seconds"], b["forward"]["seconds"]
            star = ("*", "") if row["active"][field] == first else ("", "*")
            ratios = f"({fb / fa:.2f}x; {step[1] / step[0]:.2f}x)"
            marks = [star[0] + _outgrown(a["forward"], a["backward"]), star[1] + _outgrown(b["forward"], b["backward"])]
            cells.append(f"{fa * 1e3:.2f}{marks[0]} / {fb * 1e3:.2f}{marks[1]} {ratios}")
        if any(cells):  # calls the choice does not apply to (Key blocks: head_dim 128) have no row
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return [*lines, ""]


# name: (title, what it measures, render); in the order docs/benchmarks.md shows them
SECTIONS = {
    "tpu_check_v5e": (
        "The real chip: a TPU v5e, measured (tpu_check)",
        "`python -m torch_splash_jax.tpu_check` on the TPU v5e this project borrows (JAX only there): fidelity of "
        "every kernel and feature on the chip, then each call's time, side by side in one run with JAX's own "
        "kernels, XLA's dense attention and the chip's own limits, and each row's estimate beside it. Wall clock "
        "over back-to-back calls of one compiled program, the minimum of five repetitions after a warm-up; every "
        "program is compiled before the first is timed.",
        _tpu_check,
    ),
    "active_kernels": (
        "The active-block kernels against JAX's splash kernels, per TPU generation (estimated, no TPU)",
        'The project\'s own forward and backward kernels (`BlockSizes(forward_kernel="active")`, docs/tpu.md) '
        "against the plan's JAX splash kernels on the training calls of tpu_check's table: each call's training "
        "step (forward, then backward) compiled for each generation without a TPU, its kernels estimated from "
        "libtpu's schedule (torch_splash_jax.tpu_time: an estimate, with what it leaves out). With segment ids "
        "the estimate counts the block kinds made on the host, an upper bound on the full blocks the kernels "
        "find on the device.",
        _active_kernels,
    ),
    "bridge": (
        "The bridge's cost over calling the JAX kernel directly (CPU, interpret mode)",
        "torch_splash.attention against the same jitted, vmapped splash kernel called directly on the same "
        "data (as jax arrays), and torch SDPA on the same CPU; rounds alternate, ratios are medians of "
        "per-round ratios. Target: bridge / direct JAX <= 1.05 at the large size. The small size gives the "
        "fixed cost per call (checks, plan lookup, DLPack crossings, dispatch, autograd). Interpret-mode "
        "kernels exist for development and CI: the speed is on TPU.",
        _bridge,
    ),
    "masks": (
        "Block tables for long context, and a sliding window as L grows (CPU)",
        "Building the block tables a call needs (forward and dkv, 512 blocks) with torch_splash_jax.tables vs JAX's "
        "own _process_mask on the same mask (targets: 128K tables under 1 s; >= 20x faster than JAX at 32K), "
        "and for a mask of one structured mask per head, whose partial blocks are stored (>= 20x at 32K); "
        "then the forward of a 1024-token sliding window (B=1, H=2, D=64, no grad), which should grow about "
        "linearly with L, next to SDPA with the equivalent dense bool mask, which grows quadratically.",
        _masks,
    ),
    "memory": (
        "Memory of a process that keeps meeting new shapes, default settings (CPU)",
        "torch_splash.attention (no grad, causal, B=1, H=1, D=8) over distinct lengths, a new plan and program each, "
        "in a fresh process; the baseline, in the same run, calls the splash kernel through its own module-level "
        "jax.jit, as torch_splash did before (torch_splash_jax.policy says what that kept alive). Target: after the "
        "cache has turned over, RSS per new shape under 10% of a program's while the cache fills.",
        _memory,
    ),
    "hf": (
        'HuggingFace training step: attn_implementation="splash" vs "sdpa" (CPU)',
        "Forward + loss + backward of tiny models built from configs (2 layers, hidden 256, 4 query heads of "
        "64, 2 kv heads, f32, B=1), rounds alternating after a warm-up, median of per-round ratios. With a "
        "sliding window splash skips the blocks outside it; SDPA computes the dense masked attention.",
        _hf,
    ),
    "transports": (
        "torch_xla training step: in-graph transport vs DLPack (torch_xla's CPU device)",
        "2 attention layers, GQA 4/2, causal, SGD step + sync; median step time. In-graph, a step is one "
        "XLA execution; DLPack needs one per attention call.",
        _transports,
    ),
    "flex": (
        "FlexAttention: HBM of a document-masked training step on TPU, and the host's cost of a BlockMask",
        "torch_splash.flex_attention with a BlockMask from create_block_mask, against the dense -inf bias plus "
        "SDPA that TorchTPU's flex_attention patch runs, in a torch_xla step compiled for one v5e chip; the "
        "host's cost of turning the BlockMask into splash's block tables beside create_block_mask's own "
        "(torch.compile'd, compile not counted), and again for the next layer that passes the same BlockMask "
        "(its masks are kept while its tensors and those its mask_mod reads are unchanged; under torch.compile "
        "each layer evaluates its partial blocks in the graph, and the masks built from them are kept by "
        "content); and CPU time against torch's flex_attention.",
        _flex,
    ),
    "tpu_memory": (
        "HBM per training step, from the TPU compiler (libtpu, deviceless)",
        "One training step of an attention block built in torch_xla's lazy graph with torch_splash and with "
        "torch's SDPA, compiled for one chip; where the compiler refuses a step, the figure is the one it "
        "reported. The largest L is searched in multiples of 1024.",
        _tpu_memory,
    ),
    "sequence": (
        "The query sequence sharded over devices: contiguous vs balanced",
        "Context parallelism: each device attends its own query rows to every key (k and v gathered "
        "whole). With contiguous shards the last device does almost all the causal work; the balanced "
        "layout gives each device two mirrored chunks.",
        _sequence,
    ),
    "context_parallel": (
        "Context parallelism: all-gather vs ring, HBM per chip (TPU compiler)",
        "The attention-block step with its sequence sharded over a TPU slice, k and v gathered whole on every "
        'chip (`context_parallel="all_gather"`) or passed around them (`"ring"`), compiled by libtpu for that '
        "slice without a TPU; where the compiler refuses a step, the figure is the one it reported. The input "
        "activations are computed in the step from their positions (temporaries, not arguments). The last "
        "column is read from the compiled schedule: ring permutes with a Mosaic kernel between their start and "
        "done.",
        _context_parallel,
    ),
    "fit": (
        "Will the step fit? An HF Llama training step on one v5e chip, splash vs sdpa (TPU compiler)",
        "torch_splash.fit.check on a HuggingFace LlamaForCausalLM training step (forward, loss, backward, SGD) "
        "built on torch_xla's CPU device with the kernels planned for TPU, compiled deviceless by libtpu for one "
        "chip; each attention implementation stops at its first length that does not fit. Then the longest splash "
        "length found by torch_splash.fit.largest_fitting. Example: examples/fit_llama.py.",
        _fit,
    ),
    "decode": (
        "Decoding: the decode kernel against the splash kernels and dense attention (TPU compiler, estimates)",
        "Estimates, not measurements (torch_splash_jax.tpu_time.decode, docs/tpu_time.md): each program compiled "
        "deviceless by libtpu for one device of each generation, its kernel's time read from the schedule as for "
        "the splash kernels (schedule plus HBM plus a stall per grid unit), its other ops at XLA's own estimate. "
        "The decode kernel's steps are counted at the call's key ranges (data: a shorter sequence runs fewer).",
        _decode,
    ),
    "hf_decode": (
        'One HuggingFace decode step: attn_implementation="splash" vs "sdpa" (TPU compiler, estimates)',
        "One LlamaForCausalLM layer (hidden 4096, MLP 14336, 32/8 heads of 128, bf16) with a StaticCache, one "
        "token per sequence at the middle of the cache, the position as data, built on torch_xla's CPU device and "
        "checked by torch_splash.fit.check for one device of each generation (libtpu, deviceless): the attention "
        "kernels estimated from the compiler's schedule, the rest of the step at XLA's own estimate (sdpa: all of "
        "it). The decode kernel's time is counted over the whole cache (an upper bound: it skips blocks past the "
        "position). Estimates, not measurements (docs/tpu_time.md).",
        _hf_decode,
    ),
    "tpu_time": (
        "TPU kernel time, estimated from the TPU compiler's schedule (no TPU), against tokamax's measured times",
        "An estimate, not a measurement (torch_splash_jax.tpu_time, docs/tpu_time.md): per kernel, the bundles libtpu "
        "scheduled for each path through the grid loop times the grid steps that take it, over the clock (times the "
        "generation's clock factor), plus the bytes it moves over the HBM bandwidth, plus a stall per row of the grid. "
        "The sum of schedule and HBM time, not the larger of the two (a floor): before any fitting the floor put 47%, "
        "40% and 24% of the forward entries within 25% on v5p, v6e and v7x, the sum 83%, 70% and 54%. tokamax's "
        "forward times are its kernel's alone: at 16K tokens, full mask, v5p, the schedule alone is 5.48 ms against "
        "5.37 measured, where XLA's own estimate of the transposes around the kernel would add 0.49 ms. Its backward "
        "times are its vjp op's, as its cache measured it on (residuals, out, dout, q, k, v): the kernel alone came "
        "out under every one of them, by 5% to 43%, and the estimate adds the bytes the op's transposes and scaling "
        "move.",
        _tpu_time,
    ),
}


def document() -> str:
    parts = [
        "# Benchmarks",
        "",
        "Generated by `./dev.sh bench-report` from `benchmarks/results/*.json`; do not edit by hand.",
        "Each section is the last full run of its benchmark, with the machine and the tested set (locks/)",
        "it ran on and the command that reproduces it. Ratios compare contenders measured in the same run.",
    ]
    for name, (title, about, render) in SECTIONS.items():
        path = RESULTS / f"{name}.json"
        if not path.exists():
            continue
        result = json.loads(path.read_text())
        parts += [
            "",
            f"## {title}",
            "",
            about,
            "",
            f"`{result['command']}` on {result['machine']}, {result['date']}; {result['stack']}.",
            "",
            render(result),
        ]
    return "\n".join(parts) + "\n"


def main(argv: list[str]) -> int:
    text = document()
    if "--check" in argv:
        if DOC.read_text() != text:
            print(f"{DOC.relative_to(ROOT)} does not match benchmarks/results: run ./dev.sh bench-report")
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
