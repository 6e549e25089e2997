"""How long a periodic checkpoint stops the compute side, synchronous against checkpoint_async
(world 1, an 8.4M-parameter MLP, zero1, a save every 16 steps): the seconds spent in each
periodic save (PeriodicSaver.save), the median step, and what close() waits for the last write.

    python benchmarks/checkpoint_stall.py
"""
import os
import sys
import tempfile
import time

sys.path.insert(0, os.getcwd())
import torch

from engine import Engine, EngineConfig
from engine.checkpoint.periodic import PeriodicSaver

torch.manual_seed(0)
def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Tanh(), torch.nn.Linear(2048, 2048))
def loss(m, b):
    return m(b).square().mean()
for background in (False, True):
    d = tempfile.mkdtemp()
    eng = Engine(model(), EngineConfig(strategy="zero1", max_steps=48, checkpoint_dir=d, checkpoint_every=16, checkpoint_async=background), loss)
    real, spent = PeriodicSaver.save, []
    def timed(saver, root=None):
        t = time.perf_counter(); out = real(saver, root); spent.append(time.perf_counter() - t); return out
    PeriodicSaver.save = timed
    h = eng.fit([torch.randn(8, 2048) for _ in range(48)])
    t = time.perf_counter(); eng.close(); close_s = time.perf_counter() - t
    step = sorted(e["time_s"] for e in h)[len(h)//2]
    print(f"async={background}: params {sum(p.numel() for p in eng.model.parameters())/1e6:.1f}M, save stall per periodic save {[round(s,3) for s in spent]} s, median step {step:.3f} s, close {close_s:.3f} s")
    PeriodicSaver.save = real
