# SPDX-License-Identifier: Apache-2.0
"""Random tree batches for the Gated DeltaNet tree tests, and their oracle:
each node's root path run as a chain in float64 (``Case.chain``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def random_forest(sizes, seed):
    """Packed parent rows of one random tree per request (parents first)."""
    g = torch.Generator().manual_seed(seed)
    parents, start = [], 0
    for n in sizes:
        parents.append(-1)
        for i in range(1, n):
            parents.append(start + int(torch.randint(0, i, (1,), generator=g)))
        start += n
    return torch.tensor(parents)


def root_path(parents, i):
    path = [i]
    while parents[path[-1]] >= 0:
        path.append(int(parents[path[-1]]))
    return path[::-1]


class Case:
    """R requests with random trees; slots: request r's committed conv/state in
    slot 2r + 1, node states in slots after 2R + 1 (one per row)."""

    def __init__(self, sizes=(7, 1, 12), h=2, hv=4, kd=16, vd=8, width=4, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.sizes = list(sizes)
        m, r = sum(sizes), len(sizes)
        self.parents = random_forest(sizes, seed)
        self.req = torch.repeat_interleave(torch.arange(r), torch.tensor(sizes))
        self.start_loc = torch.tensor([0] + list(torch.tensor(sizes).cumsum(0)))
        self.dim = 2 * h * kd + hv * vd
        self.h, self.hv, self.kd, self.vd, self.width = h, hv, kd, vd, width

        def rnd(*shape, s=1.0):
            return torch.randn(*shape, generator=g) * s

        self.x = rnd(m, self.dim)
        self.conv_state = rnd(2 * r + 2, self.dim, width - 1 + 3)  # spec-wide
        self.weight = rnd(self.dim, width, s=0.5)
        self.bias = rnd(self.dim, s=0.1)
        self.a, self.b = rnd(m, hv), rnd(m, hv)
        self.A_log, self.dt_bias = rnd(hv, s=0.5), rnd(hv, s=0.5)
        self.num_slots = 2 * r + 2 + m
        self.state = rnd(self.num_slots, hv, kd, vd, s=0.3)
        self.conv_slots = 2 * self.req + 1
        self.initial_slots = torch.where(self.parents < 0, 2 * self.req + 1, -1)
        self.node_slots = 2 * r + 2 + torch.arange(m)

    def split(self, y):
        hk = self.h * self.kd
        q, k, v = y.split([hk, hk, self.hv * self.vd], -1)
        return (
            q.reshape(-1, self.h, self.kd),
            k.reshape(-1, self.h, self.kd),
            v.reshape(-1, self.hv, self.vd),
        )

    def chain(self, i):
        """float64 output and final state of row i's root path as a chain."""
        path = root_path(self.parents, i)
        slot = int(self.conv_slots[i])
        committed = self.conv_state[slot, :, : self.width - 1].double()
        seq = torch.cat([committed, self.x[path].double().T], dim=1)[None]
        y = F.silu(
            F.conv1d(
                seq, self.weight.double()[:, None], self.bias.double(), groups=self.dim
            )
        )[0].T  # [len(path), D]
        q, k, v = self.split(y)
        group = self.hv // self.h
        h = self.state[int(self.initial_slots[path[0]])].double()  # [HV, K, V]
        for t, row in enumerate(path):
            qt = F.normalize(q[t], dim=-1, eps=0).repeat_interleave(group, 0)
            kt = F.normalize(k[t], dim=-1, eps=0).repeat_interleave(group, 0)
            qt = qt * self.kd**-0.5
            x = self.a[row].double() + self.dt_bias.double()
            gate = torch.exp(-torch.exp(self.A_log.double()) * F.softplus(x))
            beta = torch.sigmoid(self.b[row].double())
            h = h * gate[:, None, None]
            delta = (v[t] - torch.einsum("hkv,hk->hv", h, kt)) * beta[:, None]
            h = h + kt[:, :, None] * delta[:, None, :]
            out = torch.einsum("hkv,hk->hv", h, qt)
        return out, h
