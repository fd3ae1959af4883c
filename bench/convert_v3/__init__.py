"""The DeepSeek-V3-sized conversion benchmark's parts (``bench/bench_convert_v3.py`` is its entry point and driver).

* :mod:`bench.convert_v3.source`: DeepSeek-V3's tensor list (names, kinds, shapes) and bytes, and the random
  source checkpoint in DeepSeek's FP8 layout (written, or renamed to the next layer in place);
* :mod:`bench.convert_v3.disk`: the disk's sequential bandwidth, the filesystem under a path, and dropping a file
  from the page cache;
* :mod:`bench.convert_v3.recorder`: the run's JSON, rewritten after every stage and every heartbeat, and its
  progress lines.
"""
