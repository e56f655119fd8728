"""The pixel budget of the requests a server prepares at once.

A server decodes many requests' images at once; each image's own cap does not bound a
request of twenty of them. While a ``PixelBudget.request()`` is open (in the thread
preparing a request), every image and video decoded is charged, from its header, before
its pixels are decoded (:func:`charge_pixels`). Sources that are already pixels (PIL
images, arrays) are not.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading

from mlxvlm.media.errors import MediaError


class PixelBudgetError(MediaError):
    """A request's decoded pixels would pass its budget (``shared`` False) or that of all
    the requests being prepared at once (``shared`` True)."""

    def __init__(self, message: str, *, shared: bool):
        super().__init__(message)
        self.shared = shared
        self.limit = "max_total_pixels" if shared else "max_request_pixels"


def physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def default_pixel_budget() -> tuple[int, int]:
    """(one request, all requests being prepared at once). Preparing an image holds a few
    bytes per decoded pixel at a time (the RGB image, then the processor's copies), so a
    total of physical memory / 64 pixels keeps decoding within a small fraction of memory;
    one request may take a quarter of that."""
    memory = physical_memory() or 8 * 2**30
    total = max(memory // 64, 16_000_000)
    return total // 4, total


class PixelBudget:
    """Decoded pixels per request (``per_request``) and across all open requests
    (``total``); thread-safe."""

    def __init__(self, per_request: int, total: int):
        self.per_request = per_request
        self.total = total
        self.in_use = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def request(self):
        """Charge what is decoded in this block (in this thread) to one request, and give
        it all back at the end."""
        account = _RequestPixels(self)
        token = _active_pixels.set(account)
        try:
            yield account
        finally:
            _active_pixels.reset(token)
            with self._lock:
                self.in_use -= account.used


class _RequestPixels:
    def __init__(self, budget: PixelBudget):
        self.budget = budget
        self.used = 0

    def charge(self, pixels: int, name: str) -> None:
        budget = self.budget
        wanted = self.used + pixels
        if wanted > budget.per_request:
            raise PixelBudgetError(
                f"cannot load {name}: the request's images and video frames need at least "
                f"{wanted:,} decoded pixels, more than the limit of {budget.per_request:,} per "
                "request (the server's --max-request-pixels); send fewer or smaller images",
                shared=False)
        with budget._lock:
            if budget.in_use + pixels > budget.total:
                raise PixelBudgetError(
                    f"cannot load {name}: the server is decoding {budget.in_use:,} pixels for "
                    f"other requests, and this request's {wanted:,} would pass the limit of "
                    f"{budget.total:,} (the server's --max-total-pixels); retry in a moment",
                    shared=True)
            budget.in_use += pixels
        self.used = wanted


_active_pixels: contextvars.ContextVar[_RequestPixels | None] = contextvars.ContextVar(
    "mlxvlm_pixel_budget", default=None)


def charge_pixels(pixels: int, name: str) -> None:
    account = _active_pixels.get()
    if account is not None:
        account.charge(pixels, name)
