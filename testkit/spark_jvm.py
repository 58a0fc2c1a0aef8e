"""JVM flags for the suite's Spark processes: start quickly, compile little, run on few threads.

The analytics tests run Spark jobs over logs of a few hundred to a few thousand lines, so their
JVMs spend most of their CPU starting up and compiling, not computing: the driver of one
`run_all` made about 110 small jobs on a tiny log, and HotSpot's optimising compiler (C2) and
parallel garbage collector spent more CPU than the jobs did. C1 alone
(`-XX:TieredStopAtLevel=1`) and the serial collector roughly halved the CPU seconds of a
session's start and of a `run_all` on a 2-core machine, and no result depends on them: they
change how the JVM runs the same bytecode, never Spark's plans.

`JDK_JAVA_OPTIONS` is read by every `java` launcher (JDK 9 and later), so one variable reaches
every JVM a test starts: the `spark` fixture's driver, a `sigil-push analytics` process, and a
standalone cluster's master, worker and executors. Production runs keep the JVM's defaults.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

JVM_OPTIONS = ("-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC")
VARIABLE = "JDK_JAVA_OPTIONS"


def use_quick_jvms(environ: MutableMapping[str, str] = os.environ) -> None:
    """Add `JVM_OPTIONS` to `JDK_JAVA_OPTIONS` in `environ`, keeping what is already there
    (a developer's own flags win: later flags override earlier ones)."""
    present = environ.get(VARIABLE, "").split()
    missing = [flag for flag in JVM_OPTIONS if flag not in present]
    environ[VARIABLE] = " ".join([*missing, *present])
