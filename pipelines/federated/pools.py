"""Where the clients run: a pool of Ray actors (one serves many clients; a dead one is replaced
and its share of the round redone), or this process."""

from __future__ import annotations

import contextlib
import sys

import torch

import dpcore

from .clients import ClientRunner


class LocalPool:
    """The clients of a round run here, one share after the other (as many shares as actors,
    so that the sums are formed in the same order as on Ray), with the threads of one actor:
    the same arithmetic as the actors, so the same model, bit for bit."""

    def __init__(self, runner_args: dict, threads: int = 1):
        self.runner = ClientRunner(**runner_args, threads=None)
        self.threads = max(1, int(threads))
        self.restarts = 0

    def run_round(self, round_, weights, shares, clip_norm, want_norms) -> list[dict]:
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            return [self.runner.run(round_, weights, s, clip_norm, want_norms) for s in shares]
        finally:
            torch.set_num_threads(before)

    def close(self):
        pass


STARTUP_TIMEOUT_S = 600.0  # for every client actor to be up (each holds the training split)


class RayPool:
    """``n`` Ray actors, each a :class:`ClientRunner` on the whole (object-store) training split.

    A share whose actor dies is redone by a replacement actor, with the same clients and
    weights; the results come back in actor order, so the round's sum does not depend on
    which actor died."""

    def __init__(self, runner_args: dict, n: int, cpus_per_actor: float, max_restarts: int, fault: tuple | None = None):
        import ray

        self.ray = ray
        data_refs = {k: ray.put(runner_args[k]) for k in ("x", "y", "order", "offsets")}
        self._args = {**runner_args, **data_refs, "threads": max(1, int(cpus_per_actor))}
        self._cls = ray.remote(num_cpus=cpus_per_actor, max_restarts=0)(ClientRunner)
        have = ray.cluster_resources().get("CPU", 0.0)
        if n * cpus_per_actor > have:  # the actors beyond what fits would wait for ever, without a word (helper-42)
            raise dpcore.DPConfigError(
                f"{n} client actors of {cpus_per_actor:g} CPU(s) each need {n * cpus_per_actor:g} CPUs; the Ray cluster "
                f"has {have:g}. Lower --num-actors or --cpus-per-actor, or join a larger cluster."
            )
        self.actors = [self._start() for _ in range(n)]
        pings = [a.ping.remote() for a in self.actors]
        ready, waiting = ray.wait(pings, num_returns=len(pings), timeout=STARTUP_TIMEOUT_S)
        if waiting:
            raise RuntimeError(
                f"{len(waiting)} of {n} client actors did not start within {STARTUP_TIMEOUT_S:.0f} s "
                f"(actors {sorted(pings.index(w) for w in waiting)}); see the run's log and Ray's session logs."
            )
        ray.get(ready)
        self.max_restarts, self.restarts = max_restarts, 0
        self.fault = fault  # (round, actor) once, for tests

    def _start(self):
        return self._cls.remote(**self._args)

    def run_round(self, round_, weights, shares, clip_norm, want_norms) -> list[dict]:
        ray = self.ray
        w = ray.put(weights)
        die = [None] * len(shares)
        if self.fault is not None and self.fault[0] == round_:
            die[self.fault[1]] = max(0, len(shares[self.fault[1]]) // 2)
            self.fault = None
        futures = [a.run.remote(round_, w, s, clip_norm, want_norms, d) for a, s, d in zip(self.actors, shares, die)]
        out = []
        for i, share in enumerate(shares):
            while True:
                try:
                    out.append(ray.get(futures[i]))
                    break
                except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as e:
                    if self.restarts >= self.max_restarts:
                        raise RuntimeError(
                            f"client actor {i} died {self.restarts + 1} times (last: {type(e).__name__}); giving up"
                        ) from e
                    self.restarts += 1
                    print(
                        # (not how many clients: the round's sample is not released)
                        f"client actor {i} died in round {round_}; replacing it and redoing its share of the round",
                        file=sys.stderr,
                    )
                    with contextlib.suppress(Exception):
                        ray.kill(self.actors[i])
                    self.actors[i] = self._start()
                    futures[i] = self.actors[i].run.remote(round_, w, share, clip_norm, want_norms, None)
        return out

    def close(self):
        for a in self.actors:
            with contextlib.suppress(Exception):
                self.ray.kill(a)


# ------------------------------------------------------------------------------------------
