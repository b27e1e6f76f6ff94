"""Imported by the fork server of ``train --nproc`` (launch.py) and by nothing else: what every
rank needs, imported once before any rank is forked. The server also stops listening to
SIGTERM and SIGHUP: sent to the launcher's process group (``kill -- -PGID``, a closed
terminal), they would end the server, and with it the exit status of every rank, while the
ranks are still saving. The server still ends with the launcher, as multiprocessing's fork
server always does; each rank listens to both signals again (launch.run_rank)."""

import signal

import torchneox.cli
import torchneox.train.trainer  # noqa: F401

for _signal in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(_signal, signal.SIG_IGN)
