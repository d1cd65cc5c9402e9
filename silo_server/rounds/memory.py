"""The hub's memory per round (RoundRecord's hub_peak_rss_bytes), read from the kernel: kept apart from the round
loop, which only restarts the meter when a round opens and reads it when the round closes."""

from __future__ import annotations

import resource


class RssMeter:
    """The hub's resident memory and peak, with the kernel's peak counter restarted at each round's opening so
    that the collection phase is measured on its own (Linux /proc; elsewhere every reading is None)."""

    def __init__(self) -> None:
        self._earlier_peak = 0  # the process peak from before the latest restart

    @staticmethod
    def _status(field_name: str) -> int | None:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith(field_name + ":"):
                        return int(line.split()[1]) * 1024  # kB
        except OSError:
            return None
        return None

    def peak(self) -> int | None:
        return self._status("VmHWM")

    def restart(self) -> int | None:
        """Remember the peak so far, restart the kernel's peak at the current RSS and return that RSS."""
        self._earlier_peak = max(self._earlier_peak, self.peak() or 0)
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # 5: reset the peak resident set size to the current one
        except OSError:
            return None
        return self._status("VmRSS")

    def process_peak(self) -> int:
        usage_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        return max(self._earlier_peak, self.peak() or 0, usage_peak)
