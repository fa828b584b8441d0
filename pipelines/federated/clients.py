"""Clients for federated training: how a dataset is split among K clients, and the local
training that a client runs in one round.

Splits (both drawn with a public seed, so they cost no privacy; they are a model of how data
sits on devices, not a release):

* ``noniid`` (McMahan et al. 2017; Geyer et al. 2017): the training examples are sorted by
  label (ties in a public random order), cut into K·s contiguous shards of equal size (±1),
  and each client gets s shards at random. With s=2 most clients see two digits.
* ``iid``: a public random permutation cut into K parts of equal size (±1).

A split is held as CSR arrays: ``order`` (example indices, client by client) and ``offsets``
(K+1 positions), so 10,000 clients cost two integer tensors.

:class:`ClientRunner` trains sampled clients from the round's global weights and returns only
the sum of their clipped updates (and, for adaptive clipping, the count of updates under S).
The same class runs in the driver's process (``executor: local``) or as a Ray actor.
"""

from __future__ import annotations

import hashlib
import os

import torch
import torch.nn.functional as F

from dpcore import DPConfigError
from dpcore.federated import clip_update

from ..catalog import CLIENT_SPLITS
from ..models import build_model

SPLITS = CLIENT_SPLITS


def split_clients(
    labels: torch.Tensor, num_clients: int, split: str = "noniid", shards_per_client: int = 2, seed: int = 0
):
    """``(order, offsets)``: client k holds examples ``order[offsets[k]:offsets[k+1]]``.

    Raises DPConfigError, naming the numbers, when a client would get no data."""
    n = int(labels.shape[0])
    if split not in SPLITS:
        raise DPConfigError(f"split={split!r} is unknown; use one of {', '.join(SPLITS)}.")
    if isinstance(num_clients, bool) or not isinstance(num_clients, int) or num_clients < 1:
        raise DPConfigError(f"num_clients={num_clients!r} is invalid: it must be a positive integer.")
    g = torch.Generator().manual_seed(int(seed))
    perm = torch.randperm(n, generator=g)
    if split == "iid":
        if num_clients > n:
            raise DPConfigError(
                f"an iid split of {n} training examples over num_clients={num_clients} leaves {num_clients - n} clients with no "
                f"data; use at most {n} clients or a larger dataset (dataset: generated, generated_size: ...)."
            )
        parts = torch.tensor_split(perm, num_clients)
    else:
        if isinstance(shards_per_client, bool) or not isinstance(shards_per_client, int) or shards_per_client < 1:
            raise DPConfigError(
                f"shards_per_client={shards_per_client!r} is invalid: it must be a positive integer (Geyer et al.: 2)."
            )
        shards = num_clients * shards_per_client
        if shards > n:
            raise DPConfigError(
                f"the non-IID split asks for {num_clients} clients × {shards_per_client} shards = {shards} shards, but there are "
                f"only {n} training examples, so some shards would be empty. Use fewer clients or shards per client "
                f"(at most {n // shards_per_client} clients here), or more data (dataset: generated, generated_size: ...)."
            )
        by_label = perm[torch.sort(labels[perm], stable=True).indices]
        pieces = torch.tensor_split(by_label, shards)
        assign = torch.randperm(shards, generator=g)
        parts = [
            torch.cat([pieces[int(j)] for j in assign[k * shards_per_client : (k + 1) * shards_per_client]])
            for k in range(num_clients)
        ]
    sizes = torch.tensor([len(p) for p in parts], dtype=torch.long)
    empty = (sizes == 0).nonzero().flatten()
    if len(empty):
        raise DPConfigError(f"client {int(empty[0])} has no data after the {split} split; use fewer clients.")
    offsets = torch.zeros(num_clients + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(sizes, 0)
    return torch.cat(list(parts)), offsets


def load_flat(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy a flat vector into ``params``. (``torch.nn.utils.vector_to_parameters`` would make
    the parameters views of ``flat``, so that local training would write into the round's
    global weights.)"""
    with torch.no_grad():
        i = 0
        for p in params:
            p.copy_(flat[i : i + p.numel()].view_as(p))
            i += p.numel()


def _client_seed(shuffle_seed: int, round_: int, client: int, stream: str = "") -> int:
    digest = hashlib.sha256(f"{shuffle_seed}/{round_}/{client}{stream}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class ClientRunner:
    """Local training of sampled clients (FedAvg's ClientUpdate), one process.

    Args:
        x, y: the training split (every client's examples, indexed through ``order``).
        order, offsets: the client split (see :func:`split_clients`).
        model_name, input_shape, num_classes: the model (built once, reloaded per client).
        local_epochs, local_batch_size, local_lr: E, B and the client's SGD learning rate.
        shuffle_seed: public seed of the clients' minibatch order and of every other draw of
            their local training (dropout, say), per round and client.
        threads: torch threads of this process (None: leave them as they are).
    """

    def __init__(
        self,
        x,
        y,
        order,
        offsets,
        model_name,
        input_shape,
        num_classes,
        local_epochs,
        local_batch_size,
        local_lr,
        shuffle_seed: int = 0,
        threads: int | None = 1,
    ):
        if threads is not None:
            torch.set_num_threads(max(1, int(threads)))
        self.x, self.y, self.order, self.offsets = x, y, order, offsets
        self.model = build_model(model_name, tuple(input_shape), int(num_classes))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.epochs, self.batch, self.lr = int(local_epochs), int(local_batch_size), float(local_lr)
        self.shuffle_seed = int(shuffle_seed)

    def ping(self) -> int:
        return os.getpid()

    def _local_update(self, global_flat: torch.Tensor, round_: int, client: int) -> torch.Tensor:
        """Client ``client``'s update. Its random draws (the minibatch order, and those of the
        model, such as dropout's, which come from torch's global generator) depend on the public
        seed, the round and the client alone: drawn from one generator shared by the clients of
        a share, one client's data (how many draws its batches took) would change the next
        clients' updates, and one client could move the round's sum by more than S."""
        with torch.random.fork_rng(devices=[]):  # the global generator as it was, afterwards
            torch.manual_seed(_client_seed(self.shuffle_seed, round_, client, "/local"))
            return self._train(global_flat, round_, client)

    def _train(self, global_flat: torch.Tensor, round_: int, client: int) -> torch.Tensor:
        load_flat(self.params, global_flat)
        idx = self.order[self.offsets[client] : self.offsets[client + 1]]
        g = torch.Generator().manual_seed(_client_seed(self.shuffle_seed, round_, client))
        for _ in range(self.epochs):
            perm = idx[torch.randperm(len(idx), generator=g)]
            for start in range(0, len(perm), self.batch):
                b = perm[start : start + self.batch]
                loss = F.cross_entropy(self.model(self.x[b]), self.y[b])
                grads = torch.autograd.grad(loss, self.params)
                with torch.no_grad():
                    for p, gr in zip(self.params, grads):
                        p.sub_(gr, alpha=self.lr)
        with torch.no_grad():
            return torch.nn.utils.parameters_to_vector(self.params) - global_flat

    def run(
        self,
        round_: int,
        global_flat: torch.Tensor,
        clients: list[int],
        clip_norm: float,
        want_norms: bool = False,
        die_after: int | None = None,
    ) -> dict:
        """Train each client in ``clients`` from ``global_flat``; return the sum of the clipped
        updates (float64), the number of updates with ‖Δ‖ ≤ S (for adaptive clipping), the
        clients included, and (only when ``want_norms``, a NON-PRIVATE diagnostic) the norms.

        ``die_after`` (fault injection for tests) ends the process after that many clients."""
        self.model.train()
        total = torch.zeros(global_flat.numel(), dtype=torch.float64)
        bits, norms, done = 0, [], []
        for i, k in enumerate(clients):
            if die_after is not None and i == die_after:
                os._exit(1)
            clipped, norm, finite = clip_update(self._local_update(global_flat, round_, int(k)), clip_norm)
            total += clipped
            bits += int(finite and norm <= clip_norm)
            done.append(int(k))
            if want_norms:
                norms.append(norm)
        return {"sum": total, "bits": bits, "clients": done, "norms": norms if want_norms else None}
