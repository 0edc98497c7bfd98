"""What if: the throughput a graph would reach with one more replica of a stage, from a run's stats.

The model (a bounded-buffer pipeline at steady state, as in queueing networks' bottleneck
analysis; Flink's busy / backpressured / idle split of a task's time is the same measurement):

* Every process replica's alive time splits into *busy* (computing: not inside a channel call),
  *waiting input* (idle, in Flink's terms) and *blocked output* (backpressured). Only busy time
  is work; the other two are what a faster neighbour would remove.
* Throughput ``X`` is counted in *reference items*: the items the sources send (for
  ``examples/text_pipeline.toml``, lines). Over the window a process ``P`` with ``r`` replicas
  spent ``B_P`` busy seconds (summed over its replicas) on ``N`` reference items, so one reference
  item costs it ``B_P / N`` replica-seconds, whatever its own items are (tokenize handles one
  line per item, count a batch of lines). Its *capacity*, the throughput it alone would allow, is
  ``C_P = r * N / B_P`` reference items/s: replicas run in parallel (separate devices, or stages
  that release the GIL: sleeps, I/O, torch kernels; pure-Python CPU work in threads does not
  scale, and the model does not know it).
* A channel whose bytes cross a link of known bandwidth ``L`` (bytes/s; between ranks or hosts)
  bounds the throughput too: ``C_c = L * N / bytes_c``, bytes_c being what it moved in the window.
  Channels within a process share memory and have no bound.
* The graph runs at ``min`` over stages (and bounded channels) of their capacities; the argmin is
  the bottleneck. The capacities of a measured run already explain its throughput: ``min C``
  is ``X`` divided by the bottleneck's busy fraction, close to ``X`` when the bottleneck is busy
  all the time.
* A layout change (replica counts ``r -> r'``) scales each stage's capacity by ``r' / r``; the
  predicted throughput is ``X_measured * min C' / min C``, so whatever the model leaves out
  (startup, imperfect overlap) cancels to first order instead of being predicted as a gain.
* The gain assumes the new replica brings its own hardware. Where the header says it would not
  (stages bound to ``"cpu"`` that already keep every core of the host busy, or a GPU the stage's
  replicas share with each other or with other stages), the line says so beside the prediction
  (:func:`room_note`): on a 2-core machine a CPU stage's extra replica takes cores from the others.

:func:`fit` builds the model from a :class:`csp.observe.backpressure.Summary`; :func:`predict` evaluates
a layout; :func:`what_if_lines` gives the lines ``python -m csp.inspect`` prints, e.g. ``one more
replica of tokenize -> predicted 290 items/s (+45%)`` and ``the bottleneck moves to count at 3
replicas of tokenize (predicted 250 items/s, +25%)``.
"""

from __future__ import annotations

import math
from typing import Mapping

import msgspec

from csp.errors import UnknownProcess
from csp.observe.units import count

MIN_ITEMS = 10  # fewer reference items in the window than this: no prediction (too little evidence)


class Capacity(msgspec.Struct, frozen=True, kw_only=True):
    """One bound of the model: a process (``kind`` "process") or a link-bound channel ("channel").

    Attributes:
        name: the process or channel name.
        kind: "process" | "channel".
        replicas: the process's replicas in the measured run (1 for a channel).
        busy_s: busy replica-seconds in the window (a channel: its bytes / link bytes/s).
        capacity: the throughput it alone allows, in reference items/s.
    """

    name: str
    kind: str
    replicas: int
    busy_s: float
    capacity: float
    devices: tuple[str | None, ...] = ()


class Model(msgspec.Struct, frozen=True, kw_only=True):
    """The fitted model of one window of one run.

    Attributes:
        measured: measured throughput, reference items/s (the sources' items sent / window s).
        reference: which items are counted (e.g. "items sent by read").
        items: reference items in the window.
        bounds: every finite capacity, lowest (the bottleneck) first.
        elapsed_s: the window, in seconds.
        host_cpus: the CPU count of the machine the run was on (0: not recorded).
    """

    measured: float
    reference: str
    items: int
    bounds: list[Capacity]
    elapsed_s: float = 0.0
    host_cpus: int = 0

    @property
    def bottleneck(self) -> str | None:
        return self.bounds[0].name if self.bounds else None


def fit(summary, link_bytes_per_s: Mapping[str, float] | None = None) -> Model | None:
    """Fit the model to a :class:`csp.observe.backpressure.Summary` (module doc).

    Args:
        summary: the run's summary over its window.
        link_bytes_per_s: channel name -> bandwidth of the link it crosses (bytes/s), for the
            channel bounds; channels not named have none.

    Returns:
        The model, or None when the window holds fewer than :data:`MIN_ITEMS` reference items or
        no busy stage (nothing to extrapolate from).
    """
    dt = summary.elapsed_s
    sources = [p for p in summary.processes if p.items_in_per_s == 0 and p.items_out_per_s > 0]
    if dt <= 0 or not sources:
        return None
    items = round(sum(p.items_out_per_s for p in sources) * dt)
    if items < MIN_ITEMS:
        return None
    bounds = []
    for p in summary.processes:
        busy = sum(r.busy_frac * r.alive_s for r in p.replicas)
        if busy > 0:
            bounds.append(Capacity(name=p.name, kind="process", replicas=len(p.replicas), busy_s=busy,
                                   capacity=len(p.replicas) * items / busy, devices=tuple(p.devices)))
    for c in summary.channels:
        link = (link_bytes_per_s or {}).get(c.name)
        if link and c.bytes_per_s > 0:
            secs = c.bytes_per_s * dt / link
            bounds.append(Capacity(name=c.name, kind="channel", replicas=1, busy_s=secs,
                                   capacity=items / secs))
    if not bounds:
        return None
    bounds.sort(key=lambda b: (b.capacity, b.name))
    return Model(measured=items / dt, reference="items sent by " + "+".join(p.name for p in sources),
                 items=items, bounds=bounds, elapsed_s=dt, host_cpus=summary.host_cpus)


def predict(model: Model, replicas: Mapping[str, int]) -> tuple[float, str]:
    """Predicted throughput (reference items/s) and bottleneck with ``replicas`` (process name ->
    replica count; processes not named keep theirs). Raises UnknownProcess (a KeyError) for a
    process that is not in the model."""
    names = {b.name for b in model.bounds if b.kind == "process"}
    for n in replicas:
        if n not in names:
            raise UnknownProcess(f"no busy process {n!r} in the model (processes: {sorted(names)})")
    scaled = [(b.capacity * replicas.get(b.name, b.replicas) / b.replicas if b.kind == "process"
               else b.capacity, b.name) for b in model.bounds]
    cap, name = min(scaled)
    return model.measured * cap / model.bounds[0].capacity, name


def what_if_lines(model: Model | None, max_stages: int = 3) -> list[str]:
    """The what-if lines for ``python -m csp.inspect``: one more replica of each of the
    ``max_stages`` lowest-capacity processes, and where the bottleneck moves when the current one
    gets more replicas."""
    if model is None:
        return ["what if: not enough items in the window to predict"]
    x = model.measured
    lines = [f"what if (model: docs/inspect.md; measured {count(x)} items/s, {model.reference}):"]
    procs = [b for b in model.bounds if b.kind == "process"][:max_stages]
    for b in procs:
        y, neck = predict(model, {b.name: b.replicas + 1})
        moved = f"; bottleneck then {neck}" if neck != model.bottleneck else ""
        note = room_note(model, b) if y > x * 1.005 else ""  # no gain: nothing to qualify
        lines.append(f"  one more replica of {b.name} -> predicted {count(y)} items/s ({_gain(y, x)}){moved}{note}")
    first = model.bounds[0]
    if first.kind == "process" and len(model.bounds) > 1:
        nxt = model.bounds[1]
        k = max(first.replicas + 1, math.ceil(first.replicas * nxt.capacity / first.capacity - 1e-9))
        y, _ = predict(model, {first.name: k})
        lines.append(f"  the bottleneck moves to {nxt.name} at {k} replicas of {first.name} "
                     f"(predicted {count(y)} items/s, {_gain(y, x)})")
    elif first.kind == "channel":
        lines.append(f"  channel {first.name} is the bound: a faster link, or fewer bytes per item")
    return lines


def room_note(model: Model, stage: Capacity) -> str:
    """``" (only with a free core: ...)"`` or ``" (only on a GPU of its own: ...)"`` when the
    measured run says the new replica of ``stage`` would share hardware that is already busy,
    else "". CPU: the stages bound to ``"cpu"`` kept at least ``host_cpus - 1`` cores busy (their
    busy seconds over the window; torch's own intra-op threads make the real figure higher).
    GPU: every replica of ``stage`` is on GPUs that its other replicas or other busy stages use."""
    devs = set(stage.devices)
    if not devs or stage.kind != "process":
        return ""
    if devs == {"cpu"} and model.host_cpus and model.elapsed_s > 0:
        on_cpu = sum(b.busy_s for b in model.bounds if b.kind == "process" and set(b.devices) == {"cpu"})
        cores = on_cpu / model.elapsed_s
        if cores + 1 > model.host_cpus:
            return (f" (only with a free core: this host has {model.host_cpus} and the stages on cpu kept "
                    f"{cores:.1f} busy, more with torch's own threads)")
        return ""
    gpus = {d for d in devs if d and d.startswith("cuda")}
    if not gpus or gpus != devs:
        return ""
    sharing = sorted(b.name for b in model.bounds if b.kind == "process" and b.name != stage.name
                     and gpus & set(b.devices))
    if len(stage.devices) > len(gpus) or sharing:
        with_ = f" with {', '.join(sharing)}" if sharing else ""
        return f" (only on a GPU of its own: its replicas run on {', '.join(sorted(gpus))}{with_})"
    return ""


def _gain(y: float, x: float) -> str:
    return f"{100 * (y / x - 1):+.0f}%" if x > 0 else "n/a"


__all__ = ["Capacity", "MIN_ITEMS", "Model", "fit", "predict", "room_note", "what_if_lines"]
