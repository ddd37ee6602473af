"""What quantization breaks inside the model: induction heads, circuit edges and SAE features (issue 48).

The study is pre-registered in ``docs/preregistration/survival-1.json``; every rule below reads its numbers
from that file (:mod:`interp.report.survival.registration`), never from constants of its own.

- :mod:`~interp.report.survival.units`: the units' inputs: the frequent-token set, the repeated random
  sequences, the IOI and capital-city prompt pairs;
- :mod:`~interp.report.survival.induction`: per-sequence prefix-matching and copying scores of every head;
- :mod:`~interp.report.survival.circuits`: the reference circuit, its judged edges and their per-pair effects;
- :mod:`~interp.report.survival.roster`: every quantized model of the registration, made or loaded;
- :mod:`~interp.report.survival.run`: the resumable run that writes the raw data;
- :mod:`~interp.report.survival.analyse`: the registered statistics and verdicts, from the raw data only.
"""
