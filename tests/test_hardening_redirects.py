"""The login's ``next`` target: known open-redirect bypasses are refused, the service's
own pages are kept (the rule itself; tests/test_hardening_http.py logs in for real)."""

from __future__ import annotations

import pytest

from broker.service.pages.redirects import is_local_target

#: What browsers, proxies or second decoders read as another site (or as no page of
#: the service), each as sent in ``next``.
BYPASSES = [
    "https://evil.example/",
    "http:evil.example",
    "javascript:alert(1)",
    "//evil.example/",
    "///evil.example/",
    "/\\evil.example/",
    "/\\/evil.example/",
    "\\\\evil.example/",
    "/\t/evil.example/",
    "/\n/evil.example/",
    "/\r\n/evil.example/",
    "/ /evil.example/",
    "/\u3000/evil.example/",  # ideographic space
    "/\u200b/evil.example/",  # zero-width space (a format character)
    "/\x00/evil.example/",
    "/%5Cevil.example/",
    "/%5C/evil.example/",
    "/%2F/evil.example/",
    "/%2f%2fevil.example/",
    "/%09/evil.example/",
    "/%252F%252Fevil.example/",  # encoded twice
    "/%25252F%25252Fevil.example/",  # three times
    "/%2525252525252F/evil.example/",  # more times than anyone sends by mistake
    "/.//evil.example/",
    "/./evil.example/",
    "/gpus/../..//evil.example/",
    "/gpus/%2E%2E/%2E%2E//evil.example/",
    " //evil.example/",
    "evil.example",
    "",
]


@pytest.mark.parametrize("target", BYPASSES)
@pytest.mark.parametrize("base", ["/", "/services/slicebroker/"])
def test_a_known_open_redirect_bypass_is_refused(target, base):
    assert not is_local_target(target, base)


@pytest.mark.parametrize(
    "target",
    [
        "{base}gpus",
        "{base}queue",
        "{base}usage?since=2026-01-01&until=2026-02-01&project=vision",
        "{base}cluster#nodes",
        "{base}",
        "{base}ui/fragment/gpus?project=a%2Cb",
    ],
)
@pytest.mark.parametrize("base", ["/", "/services/slicebroker/"])
def test_a_page_of_the_service_is_kept(target, base):
    assert is_local_target(target.format(base=base), base)


def test_a_page_outside_the_services_prefix_is_refused():
    assert not is_local_target("/hub/admin", "/services/slicebroker/")
    assert not is_local_target("/services/slicebroker/../../hub/admin", "/services/slicebroker/")
