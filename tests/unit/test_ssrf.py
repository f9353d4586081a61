"""The SSRF guard on a corpus of addresses aimed inside, with a stub resolver (no network)."""

import pytest

from shared.ssrf import AllowList, RefusedURL, check_url, literal_ip, resolve_and_check

INSIDE = [
    "http://127.0.0.1/", "http://127.1/", "http://localhost/", "http://[::1]/", "http://10.0.0.5/",
    "http://172.16.3.4/", "http://192.168.1.1/", "http://169.254.169.254/latest/meta-data/",
    "http://[::ffff:a9fe:a9fe]/", "http://[::ffff:127.0.0.1]/", "http://2852039166/", "http://0251.0376.0251.0376/",
    "http://0xa9fea9fe/", "http://0x7f000001/", "http://2130706433/", "http://0177.0.0.1/", "http://0.0.0.0/",
    "http://100.64.0.1/", "http://224.0.0.1/", "http://[fe80::1]/", "http://[fc00::1]/", "http://240.0.0.1/",
    "http://[2002:a9fe:a9fe::]/",  # 6to4 wrapping the metadata address
    "http://[64:ff9b::a00:1]/", "http://[::ffff:0:a9fe:a9fe]/", "http://[::127.0.0.1]/", "http://[fec0::1]/",
    "http://internal.example/",  # resolves to a private address (stub below)
    "http://127.0.0.1./", "http://localhost./", "http://internal.example./",  # the root's trailing dot
]
STUB = {"internal.example": ["10.1.2.3"], "localhost": ["127.0.0.1", "::1"], "hooks.example.com": ["93.184.216.34"],
        "mixed.example": ["93.184.216.34", "10.0.0.1"]}


def stub(host: str, port: int) -> list[str]:
    if host not in STUB:
        raise OSError(f"no such host {host}")
    return STUB[host]


@pytest.mark.parametrize("url", INSIDE)
def test_inside_addresses_are_refused_at_delivery(url):
    with pytest.raises(RefusedURL):
        resolve_and_check(url, AllowList(), stub)


@pytest.mark.parametrize("url", [u for u in INSIDE if "example" not in u and "localhost" not in u])
def test_ip_literals_in_any_spelling_are_refused_at_submit(url):
    with pytest.raises(RefusedURL):
        check_url(url, AllowList())


def test_public_names_pass_and_are_pinned():
    target = resolve_and_check("https://hooks.example.com:8443/x?y=1", AllowList(), stub)
    assert (target.ip, target.host, target.port, target.path, target.scheme) == (
        "93.184.216.34", "hooks.example.com", 8443, "/x?y=1", "https")


def test_one_private_address_among_public_ones_is_enough_to_refuse():
    with pytest.raises(RefusedURL):
        resolve_and_check("http://mixed.example/", AllowList(), stub)


@pytest.mark.parametrize("url", ["ftp://x.example/", "file:///etc/passwd", "gopher://x/", "http://", "not a url",
                                 "http://user:pw@hooks.example.com/", "http://hooks.example.com:99999/", "x" * 3000,
                                 "http://exa mple.com/", " http://hooks.example.com/", "https://h.example.com/a b",
                                 "http://hooks.example.com/\n", "", "http://hooks.example.com:0/", "http://.:80/"])
def test_plainly_invalid_urls_are_refused_at_submit(url):
    with pytest.raises(RefusedURL):
        check_url(url, AllowList())


def test_an_empty_url_and_one_with_spaces_are_named_as_such():
    with pytest.raises(RefusedURL, match="empty"):
        check_url("", AllowList())
    with pytest.raises(RefusedURL, match="white space"):
        check_url("http://exa mple.com/", AllowList())


def test_urls_are_stored_with_scheme_and_host_in_lower_case():
    """A receiver's 410 disables its URL however the caller spells its scheme and host (the rest is as given)."""
    from shared.ssrf import normalized_url

    assert normalized_url("HTTP://Hooks.Example.COM:8080/Path?Q=A") == "http://hooks.example.com:8080/Path?Q=A"
    assert normalized_url("https://hooks.example.com/x") == "https://hooks.example.com/x"


def test_a_url_is_stored_as_it_is_sent_without_fragment_or_trailing_dot():
    """Spellings of one destination are one URL: the fragment is never sent (`/gone#x` reached the URL a 410 had
    disabled) and `example.com.` is `example.com`; IPv6 and explicit ports kept."""
    from shared.ssrf import normalized_url

    assert normalized_url("http://hooks.example.com/gone#x") == "http://hooks.example.com/gone"
    assert normalized_url("http://Hooks.Example.com.:8080/a?b#c") == "http://hooks.example.com:8080/a?b"
    assert normalized_url("http://[2001:DB8::1]:9/x") == "http://[2001:db8::1]:9/x"
    assert normalized_url("https://hooks.example.com:443/") == "https://hooks.example.com:443/"
    target = resolve_and_check("http://hooks.example.com./x", AllowList(), stub)
    assert (target.host, target.ip) == ("hooks.example.com", "93.184.216.34")  # resolved as the name it is
    loopback = AllowList.parse("127.0.0.0/8")
    assert resolve_and_check("http://127.0.0.1.:18599/ok", loopback, stub).ip == "127.0.0.1"  # an IP, not a name


def test_unresolvable_host_is_refused_at_delivery():
    with pytest.raises(RefusedURL, match="cannot resolve"):
        resolve_and_check("http://nowhere.example/", AllowList(), stub)


def test_operator_allow_list_by_network_and_by_host():
    allow = AllowList.parse("127.0.0.0/8, internal.example, ::1")
    assert resolve_and_check("http://127.0.0.1:9/", allow, stub).ip == "127.0.0.1"
    assert resolve_and_check("http://internal.example/", allow, stub).ip == "10.1.2.3"
    assert resolve_and_check("http://[::1]/", allow, stub).ip == "::1"
    with pytest.raises(RefusedURL):
        resolve_and_check("http://10.0.0.5/", allow, stub)


def test_literal_ip_spellings():
    assert str(literal_ip("2852039166")) == "169.254.169.254"
    assert str(literal_ip("0xa9fea9fe")) == "169.254.169.254"
    assert str(literal_ip("0251.0376.0251.0376")) == "169.254.169.254"
    assert literal_ip("hooks.example.com") is None


@pytest.mark.parametrize("entry", ["10.20.0.0/33", "10.1.2.300", "300.1.2.3", "hooks example", "fe80::1::2/64",
                                   "a/b"])
def test_mistyped_allow_list_entries_are_errors_not_host_names(entry):
    with pytest.raises(ValueError, match="allow-list entry"):
        AllowList.parse(f"127.0.0.0/8,{entry}")


@pytest.mark.parametrize("entry", ["0.0.0.0/0", "::/0", "0.0.0.0/1", "128.0.0.0/1", "::/1",
                                   # IPv6 networks carrying all (or a /8 and more) of IPv4: mapped, compatible,
                                   # NAT64, 6to4, Teredo, and a wider network around them
                                   "::ffff:0:0/96", "::ffff:0:0/100", "::/96", "64:ff9b::/96", "::/80",
                                   "2002::/16", "2002:a00::/22", "2001::/32", "::ffff:0:0:0/96"])
def test_guard_disabling_entries_need_force(entry):
    with pytest.raises(ValueError, match="turns the SSRF guard off"):
        AllowList.parse(entry)
    forced = AllowList.parse(f"force:{entry}")
    assert forced.forced == (str(forced.networks[0]),)


@pytest.mark.parametrize("entry", ["::ffff:10.0.0.0/104", "::ffff:10.1.2.3", "2002:a00::/24", "::1",
                                   "fe80::/10", "169.254.0.0/16", "10.0.0.0/8", "2001:db8::/32"])
def test_narrow_entries_and_named_link_local_are_accepted_as_they_are(entry):
    assert AllowList.parse(entry).forced == ()


def test_a_mapped_loopback_is_refused_unless_its_own_range_is_allowed():
    with pytest.raises(RefusedURL):
        resolve_and_check("http://[::ffff:127.0.0.1]/", AllowList.parse("10.0.0.0/8"), stub)
    assert resolve_and_check("http://[::ffff:127.0.0.1]/", AllowList.parse("::ffff:127.0.0.0/104"), stub).ip \
        == "::ffff:7f00:1"


def test_settings_refuse_a_bad_allow_list_at_start_up():
    from shared.config import Settings
    from shared.errors import ConfigError

    with pytest.raises(ConfigError, match=r"10\.20\.0\.0/33"):
        Settings(callback_allow="10.20.0.0/33").validate()
    with pytest.raises(ConfigError, match="force:"):
        Settings(callback_allow="0.0.0.0/0").validate()
    Settings(callback_allow="10.20.0.0/16, hooks.internal, force:0.0.0.0/0").validate()


@pytest.mark.parametrize("url", ["http://169.254.169.254/latest/", "http://[::ffff:a9fe:a9fe]/", "http://2852039166/",
                                 "http://[fd00:ec2::254]/", "http://[fe80::1]/", "http://[::ffff:169.254.1.1]/"])
def test_metadata_and_link_local_stay_refused_under_a_forced_wide_entry(url):
    allow = AllowList.parse("force:0.0.0.0/0, force:::/0")
    with pytest.raises(RefusedURL):
        check_url(url, allow)
    with pytest.raises(RefusedURL):
        resolve_and_check(url, allow, stub)
    assert resolve_and_check("http://10.0.0.5/", allow, stub).ip == "10.0.0.5"  # the rest is allowed


def test_metadata_is_allowed_when_named_explicitly():
    allow = AllowList.parse("169.254.169.254, fd00:ec2::254, ::ffff:169.254.169.254")
    assert resolve_and_check("http://169.254.169.254/", allow, stub).ip == "169.254.169.254"
    assert resolve_and_check("http://[fd00:ec2::254]/", allow, stub).ip == "fd00:ec2::254"
    assert resolve_and_check("http://[::ffff:a9fe:a9fe]/", allow, stub).ip == "::ffff:a9fe:a9fe"


def test_an_allowed_name_still_has_its_resolved_address_checked():
    def resolver(host, port):
        return {"hooks.internal": ["10.20.1.2"], "evil.example": ["169.254.169.254"],
                "evil6.example": ["::ffff:169.254.169.254"]}[host]

    allow = AllowList.parse("hooks.internal, evil.example, evil6.example")
    assert resolve_and_check("http://hooks.internal/", allow, resolver).ip == "10.20.1.2"  # private: the point
    for name in ("evil.example", "evil6.example"):
        with pytest.raises(RefusedURL, match="metadata"):
            resolve_and_check(f"http://{name}/", allow, resolver)


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST.", "app.localhost", "db.internal", "printer.local",
                                  "metadata.google.internal", "intranet", "hooks.", "nas.home.arpa", "box.lan",
                                  "x.corp", "router.home", "db.localdomain"])
def test_obviously_internal_names_are_refused_at_submit_unless_allowed(host):
    with pytest.raises(RefusedURL, match="internal name"):
        check_url(f"http://{host}:8080/hook", AllowList())
    check_url(f"http://{host}:8080/hook", AllowList.parse(host.rstrip(".")))
    for ordinary in ("hooks.example.com", "example.com.", "hooks.corp.example.com", "lan.example"):
        check_url(f"http://{ordinary}/x", AllowList())  # ordinary names still pass submit


def test_refusals_shown_to_api_callers_name_no_environment_variable():
    for url in ("http://10.0.0.5/", "http://localhost/", "http://169.254.169.254/"):
        with pytest.raises(RefusedURL) as exc:
            check_url(url, AllowList())
        assert "BATCHGATE" not in str(exc.value) and "_ALLOW" not in str(exc.value)
