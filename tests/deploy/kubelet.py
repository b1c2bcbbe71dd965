"""A pod's probes, run as the kubelet runs them, from the node's side of the network.

For each container probe (gRPC on grpc.health.v1, or a TCP connect): the
startup probe first, every ``periodSeconds`` after ``initialDelaySeconds``,
until one success; ``failureThreshold`` failures in a row mean the kubelet
would kill the container. Then readiness and liveness, each on its own
period: readiness turns Ready after ``successThreshold`` successes in a row
and not Ready after ``failureThreshold`` failures in a row; liveness failing
``failureThreshold`` times in a row means a restart. A probe that does not
answer within ``timeoutSeconds`` has failed. Defaults are Kubernetes' own.

Nothing is killed here: ``PodProbes`` records what the kubelet would do, and
the tests assert it never had to.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvmesh.healthcheck import check_health

_DEFAULTS = {"initialDelaySeconds": 0, "periodSeconds": 10, "timeoutSeconds": 1,
             "successThreshold": 1, "failureThreshold": 3}


@dataclass(frozen=True)
class Probe:
    """One probe of a container: how to run it and its timing."""

    ip: str
    action: dict[str, Any]  # {"grpc": {...}} or {"tcpSocket": {...}}
    port: int
    initial_delay_s: float
    period_s: float
    timeout_s: float
    success_threshold: int
    failure_threshold: int

    @classmethod
    def from_spec(cls, spec: dict[str, Any], ip: str, port: int) -> Probe:
        s = {**_DEFAULTS, **spec}
        action = {k: v for k, v in spec.items() if k in ("grpc", "tcpSocket", "httpGet", "exec")}
        if not action.keys() <= {"grpc", "tcpSocket"}:
            raise ValueError(f"unsupported probe action {sorted(action)}")
        return cls(ip, action, port, s["initialDelaySeconds"], s["periodSeconds"],
                   s["timeoutSeconds"], s["successThreshold"], s["failureThreshold"])

    def passes(self) -> bool:
        if "grpc" in self.action:
            service = self.action["grpc"].get("service", "")
            return check_health(f"{self.ip}:{self.port}", service,
                                timeout_s=self.timeout_s) == "SERVING"
        try:
            with socket.create_connection((self.ip, self.port), timeout=self.timeout_s):
                return True
        except OSError:
            return False


@dataclass
class PodProbes:
    """The kubelet's view of one container, kept up to date by a thread."""

    name: str
    startup: Probe | None
    readiness: Probe | None
    liveness: Probe | None
    started_at: float = field(default_factory=time.monotonic)
    startup_s: float | None = None  # when the startup probe first passed
    startup_failed: bool = False  # the kubelet would have killed the container
    ready: bool = False
    liveness_restarts: int = 0  # times liveness reached its failure threshold
    history: list[tuple[float, str, bool]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> PodProbes:
        threading.Thread(target=self._run, name=f"kubelet-{self.name}", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _record(self, kind: str, probe: Probe) -> bool:
        ok = probe.passes()
        self.history.append((time.monotonic() - self.started_at, kind, ok))
        return ok

    def _run(self) -> None:
        if self.startup is not None and not self._run_startup(self.startup):
            return
        self.startup_s = time.monotonic() - self.started_at
        probes = [(kind, p) for kind, p in (("readiness", self.readiness),
                                            ("liveness", self.liveness)) if p is not None]
        if self.readiness is None:
            self.ready = True
        due = {kind: time.monotonic() + p.initial_delay_s for kind, p in probes}
        streak = {kind: 0 for kind, _ in probes}  # >0 successes, <0 failures in a row
        while not self._stop.is_set():
            for kind, probe in probes:
                if time.monotonic() < due[kind]:
                    continue
                due[kind] += probe.period_s
                ok = self._record(kind, probe)
                streak[kind] = max(streak[kind], 0) + 1 if ok else min(streak[kind], 0) - 1
                self._apply(kind, probe, streak[kind])
            self._stop.wait(0.05)

    def _run_startup(self, probe: Probe) -> bool:
        if self._stop.wait(probe.initial_delay_s):
            return False
        failures = 0
        while not self._stop.is_set():
            if self._record("startup", probe):
                return True
            failures += 1
            if failures >= probe.failure_threshold:
                self.startup_failed = True
                return False
            self._stop.wait(probe.period_s)
        return False

    def _apply(self, kind: str, probe: Probe, streak: int) -> None:
        if kind == "readiness":
            if streak >= probe.success_threshold:
                self.ready = True
            elif -streak >= probe.failure_threshold:
                self.ready = False
        elif -streak == probe.failure_threshold:
            self.liveness_restarts += 1


def probes_for(name: str, container: dict[str, Any], ip: str,
               port_of) -> PodProbes:
    """A container's three probes (each may be absent); ``port_of`` turns a
    probe's port (number or name) into a number."""
    def probe(key: str) -> Probe | None:
        spec = container.get(key)
        if spec is None:
            return None
        action = spec.get("grpc") or spec.get("tcpSocket")
        return Probe.from_spec(spec, ip, port_of(action["port"]))
    return PodProbes(name, probe("startupProbe"), probe("readinessProbe"), probe("livenessProbe"))
