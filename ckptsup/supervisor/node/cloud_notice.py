"""Cloud preemption notices (docs/cloud.md): a spot reclaim on a cloud Slurm cluster comes as an
answer of the instance metadata service, not as a Slurm signal. The agent polls its node's cloud
every POLL_S with a TIMEOUT_S timeout, on a thread of its own (the agent's loop never waits on
HTTP), and sends each new notice up as a `cloud_notice` frame.

What is asked, and what each answer means (the sources are in docs/cloud.md):
  aws    IMDSv2: PUT /latest/api/token (X-aws-ec2-metadata-token-ttl-seconds), then
         GET /latest/meta-data/spot/instance-action with X-aws-ec2-metadata-token: 404 = no notice;
         200 = {"action": "terminate" | "stop" | "hibernate", "time": "YYYY-MM-DDTHH:MM:SSZ"}.
  gcp    GET /computeMetadata/v1/instance/preempted with Metadata-Flavor: Google: "FALSE" = no
         notice; "TRUE" = preempted: the guest has PREEMPT_GCP_S (30 s) from the ACPI soft-off.
  azure  GET /metadata/scheduledevents?api-version=2020-07-01 with Metadata: true: {"Events":
         [...]}; a `Preempt` (or `Terminate`) event whose `Resources` names this VM is a notice
         for its `NotBefore` (RFC 1123, "" once started). The VM's name is asked once
         (/metadata/instance/compute/name).

Which cloud a node is on (`auto`) is read from its DMI strings (`detect`, `DMI_ROOT`): a node that
names none of the three is never polled. Everything here is bounded: one body is read up to
MAX_BODY bytes, a malformed answer or an unreachable service is one warning per kind of problem
(never a crash, never a traceback), proxies from the environment are not used (the metadata
service is link-local) and redirects are not followed. The parsers are pure and take `now`.
"""

from __future__ import annotations

import datetime as _dt
import email.utils
import enum
import queue
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from ... import console
from ..._version import __version__
from ...errors import CkptsupError
from ...safe_io import loads_json

POLL_S = 5.0            # AWS: "We recommend that you check for these interruption notices every 5 seconds."
TIMEOUT_S = 1.0         # per request: an answer of the link-local service takes milliseconds
MAX_BODY = 64 * 1024    # an instance-action is ~60 bytes, a scheduled-events document a few KiB
PREEMPT_GCP_S = 30.0    # GCP: the ACPI G2 soft-off gives the guest 30 s before the VM stops
TOKEN_TTL_S = 21600     # IMDSv2 token lifetime asked for (its maximum, 6 h); renewed a minute early
MAX_AHEAD_S = 7 * 86400   # a notice further ahead is sent as a week ahead (the frame's bound)
AZURE_API = "2020-07-01"
AZURE_NAME_API = "2021-02-01"
DMI_ROOT = Path("/sys/class/dmi/id")
DMI_FIELDS = ("sys_vendor", "bios_vendor", "bios_version", "product_name", "product_version", "chassis_asset_tag")
AZURE_ASSET_TAG = "7783-7084-3265-9085-8269-3286-77"   # Azure's chassis asset tag (what cloud-init checks)
AWS_ACTIONS = frozenset({"terminate", "stop", "hibernate"})
AZURE_TYPES = frozenset({"Preempt", "Terminate"})      # the VM goes away; Freeze, Reboot, Redeploy: it comes back


class Cloud(str, enum.Enum):
    AWS = "aws"
    GCP = "gcp"
    AZURE = "azure"


DEFAULT_ENDPOINTS = {Cloud.AWS: "http://169.254.169.254", Cloud.GCP: "http://metadata.google.internal",
                     Cloud.AZURE: "http://169.254.169.254"}


@dataclass(frozen=True, kw_only=True)
class Notice:
    """A reclaim announced by the cloud: `action` at `deadline` (seconds since the epoch, UTC)."""

    cloud: Cloud
    action: str
    deadline: float
    detail: str = ""

    def ahead_s(self, now: float) -> float:
        """Seconds from `now` to the deadline: 0 when past, at most MAX_AHEAD_S (a week)."""
        return min(MAX_AHEAD_S, max(0.0, self.deadline - now))

    def deadline_iso(self) -> str:
        try:
            return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.deadline))
        except (OverflowError, OSError, ValueError):   # a time no clock shows (the parsers keep years 1-9999)
            return "?"

    def key(self) -> tuple[str, str, int]:
        return (self.cloud.value, self.action, round(self.deadline))


@dataclass(frozen=True)
class Problem:
    """A poll that said nothing usable (unreachable, refused, malformed): `kind` names it for the
    once-per-kind warning, `text` says what was seen."""

    kind: str
    text: str


NO_NOTICE = None   # a poll's answer: a Notice, NO_NOTICE, or a Problem
Answer = Notice | Problem | None


# ---- which cloud (DMI) ----------------------------------------------------------------------------
def read_dmi(root: Path = DMI_ROOT) -> dict[str, str]:
    """The DMI strings ckptsup looks at (absent or unreadable ones are left out)."""
    out: dict[str, str] = {}
    for name in DMI_FIELDS:
        try:
            with open(root / name, "rb") as f:
                out[name] = f.read(256).decode("utf-8", "replace").strip()
        except OSError:
            continue
    return out


def detect(dmi: Mapping[str, str]) -> Cloud | None:
    """The cloud a node's DMI strings name: AWS Nitro says "Amazon EC2" (sys_vendor, bios_vendor),
    its older Xen instances an "amazon" BIOS version; GCP says "Google" (product_name "Google
    Compute Engine"); Azure says "Microsoft Corporation" with its chassis asset tag (a Hyper-V VM
    elsewhere says the same vendor without it)."""
    vendor, bios = dmi.get("sys_vendor", ""), dmi.get("bios_vendor", "")
    if "Amazon EC2" in (vendor, bios) or "amazon" in dmi.get("bios_version", "").lower() \
            or "amazon" in dmi.get("product_version", "").lower():
        return Cloud.AWS
    if vendor == "Google" or bios == "Google" or dmi.get("product_name", "") == "Google Compute Engine":
        return Cloud.GCP
    if vendor == "Microsoft Corporation" and dmi.get("chassis_asset_tag", "") == AZURE_ASSET_TAG:
        return Cloud.AZURE
    return None


def resolve(setting: str, dmi_root: Path = DMI_ROOT) -> Cloud | None:
    """`[preemption] cloud_notice` on this node: the cloud to poll, or None (off, or auto on a
    node that names no cloud)."""
    if setting == "off":
        return None
    if setting == "auto":
        return detect(read_dmi(dmi_root))
    return Cloud(setting)


# ---- the parsers (pure) ---------------------------------------------------------------------------
def parse_aws(status: int, body: bytes) -> Answer:
    """GET /latest/meta-data/spot/instance-action: 404 no notice; 200 the action and its time."""
    if status == 404:
        return NO_NOTICE
    if status != 200:
        return Problem(f"aws-http-{status}", f"spot/instance-action answered HTTP {status}")
    data = _json(body)
    if not isinstance(data, dict) or data.get("action") not in AWS_ACTIONS or not isinstance(data.get("time"), str):
        return Problem("aws-malformed", f"spot/instance-action is not {{action, time}}: {_shown(body)}")
    when = _iso_time(data["time"])
    if when is None:
        return Problem("aws-malformed", f"spot/instance-action time is not an ISO 8601 UTC time: {data['time'][:40]!r}")
    return Notice(cloud=Cloud.AWS, action=data["action"], deadline=when, detail=f"spot instance-action {data['action']}")


def parse_gcp(status: int, body: bytes, now: float, *, first_seen: float | None = None) -> Answer:
    """GET /computeMetadata/v1/instance/preempted: "FALSE" no notice; "TRUE" preempted, the VM stops
    PREEMPT_GCP_S after the notice (from `first_seen`, the poll that first saw TRUE, else `now`)."""
    if status != 200:
        why = " (the request lacked Metadata-Flavor: Google?)" if status == 403 else ""
        return Problem(f"gcp-http-{status}", f"instance/preempted answered HTTP {status}{why}")
    text = body.decode("ascii", "replace").strip()
    if text == "FALSE":
        return NO_NOTICE
    if text == "TRUE":
        start = now if first_seen is None else first_seen
        return Notice(cloud=Cloud.GCP, action="preempted", deadline=start + PREEMPT_GCP_S, detail="instance/preempted TRUE")
    return Problem("gcp-malformed", f"instance/preempted is neither TRUE nor FALSE: {_shown(body)}")


def parse_azure(status: int, body: bytes, names: frozenset[str], now: float) -> Answer:
    """GET /metadata/scheduledevents: the first Preempt or Terminate event naming one of `names`
    (this VM) in its Resources; its NotBefore ("" once started: now)."""
    if status != 200:
        why = " (the request lacked Metadata: true?)" if status == 400 else ""
        return Problem(f"azure-http-{status}", f"scheduledevents answered HTTP {status}{why}")
    data = _json(body)
    events = data.get("Events") if isinstance(data, dict) else None
    if not isinstance(events, list):
        return Problem("azure-malformed", f"scheduledevents has no Events list: {_shown(body)}")
    for event in events:
        if not isinstance(event, dict):
            return Problem("azure-malformed", f"a scheduled event is not an object: {_shown(body)}")
        kind, resources, not_before = event.get("EventType"), event.get("Resources"), event.get("NotBefore", "")
        if not isinstance(kind, str) or not isinstance(resources, list) or not isinstance(not_before, str):
            return Problem("azure-malformed", f"a scheduled event lacks EventType, Resources or NotBefore: {_shown(body)}")
        if kind not in AZURE_TYPES or not names.intersection(r for r in resources if isinstance(r, str)):
            continue   # another kind of event, or one for another VM of the availability set
        when = now if not not_before else _rfc1123(not_before)
        if when is None:
            return Problem("azure-malformed", f"NotBefore is not an RFC 1123 time: {not_before[:40]!r}")
        event_id = event.get("EventId")
        return Notice(cloud=Cloud.AZURE, action=kind.lower(), deadline=when,
                      detail=f"scheduled event {kind}" + (f" {event_id}" if isinstance(event_id, str) else ""))
    return NO_NOTICE


class _Malformed(CkptsupError):
    """A metadata answer that is not the JSON it should be."""


def _json(body: bytes) -> object:
    try:
        return loads_json(body, what="metadata answer", error=_Malformed, max_depth=8)
    except _Malformed:
        return None


def _iso_time(text: str) -> float | None:
    try:
        when = _dt.datetime.fromisoformat(text)
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=_dt.timezone.utc)
    return when.timestamp()


def _rfc1123(text: str) -> float | None:
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=_dt.timezone.utc)
    return when.timestamp()


def _shown(body: bytes) -> str:
    text = body[:80].decode("utf-8", "replace")
    return repr(text) + ("..." if len(body) > 80 else "")


# ---- HTTP (urllib, bounded) -------------------------------------------------------------------------
class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *_args: object, **_kwargs: object) -> None:
        return None   # a metadata service never redirects; a 3xx is an answer like any other


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


def http(method: str, url: str, headers: Mapping[str, str], timeout: float = TIMEOUT_S) -> tuple[int, bytes]:
    """(status, at most MAX_BODY bytes of body). OSError (refused, unreachable, timed out) passes."""
    request = urllib.request.Request(url, method=method, headers=dict(headers),
                                     data=b"" if method == "PUT" else None)
    try:
        with _OPENER.open(request, timeout=timeout) as answer:
            return answer.status, answer.read(MAX_BODY)
    except urllib.error.HTTPError as err:
        try:
            body = err.read(MAX_BODY)
        except OSError:
            body = b""
        finally:
            err.close()
        return err.code, body


Http = Callable[[str, str, Mapping[str, str], float], tuple[int, bytes]]


class Poller:
    """One cloud's protocol with what it keeps between polls (AWS's token, Azure's VM name, when
    GCP's TRUE was first seen). `poll()` does one round and returns its Answer; never raises."""

    def __init__(self, *, cloud: Cloud, endpoint: str, node: str, http: Http = http,
                 clock: Callable[[], float] = time.time, timeout_s: float = TIMEOUT_S) -> None:
        self.cloud = cloud
        self.base = endpoint.rstrip("/")
        self.node = node
        self.http = http
        self.clock = clock
        self.timeout_s = timeout_s
        # the node's name rides along (a site's proxy, and the tests' server, may answer per node)
        self.agent = {"User-Agent": f"ckptsup/{__version__} (node {node})"}
        self.token: str | None = None
        self.token_until = 0.0
        self.azure_names: frozenset[str] | None = None
        self.gcp_since: float | None = None

    def poll(self) -> Answer:
        try:
            if self.cloud is Cloud.AWS:
                return self._aws()
            if self.cloud is Cloud.GCP:
                return self._gcp()
            return self._azure()
        except TimeoutError:
            return Problem(f"{self.cloud.value}-timeout", f"no answer within {self.timeout_s:g}s")
        except OSError as err:   # refused, unreachable, a name that does not resolve, a reset
            reason = getattr(err, "reason", None) or err.strerror or err
            if isinstance(reason, TimeoutError) or isinstance(reason, socket.timeout):
                return Problem(f"{self.cloud.value}-timeout", f"no answer within {self.timeout_s:g}s")
            return Problem(f"{self.cloud.value}-unreachable", f"cannot reach {self.base}: {reason}")
        except Exception as err:   # noqa: BLE001 - an http.client oddity (a bad status line): one warning, never a crash
            return Problem(f"{self.cloud.value}-bad-answer", f"{type(err).__name__}: {str(err)[:120]}")

    def _aws(self) -> Answer:
        now = self.clock()
        if self.token is None or now >= self.token_until:
            status, body = self.http("PUT", f"{self.base}/latest/api/token",
                                     {**self.agent, "X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)},
                                     self.timeout_s)
            token = body.decode("ascii", "replace").strip()
            if status != 200 or not token or len(token) > 4096:
                return Problem(f"aws-token-{status}", f"the IMDSv2 token was refused: HTTP {status}"
                               + (" (IMDS disabled, or the hop limit?)" if status in (401, 403) else ""))
            self.token, self.token_until = token, now + TOKEN_TTL_S - 60
        status, body = self.http("GET", f"{self.base}/latest/meta-data/spot/instance-action",
                                 {**self.agent, "X-aws-ec2-metadata-token": self.token}, self.timeout_s)
        if status == 401:   # the token expired or was not taken: a new one next time
            self.token = None
            return Problem("aws-http-401", "spot/instance-action refused the IMDSv2 token (HTTP 401); asking for a new one")
        return parse_aws(status, body)

    def _gcp(self) -> Answer:
        status, body = self.http("GET", f"{self.base}/computeMetadata/v1/instance/preempted",
                                 {**self.agent, "Metadata-Flavor": "Google"}, self.timeout_s)
        now = self.clock()
        answer = parse_gcp(status, body, now, first_seen=self.gcp_since)
        if isinstance(answer, Notice) and self.gcp_since is None:
            self.gcp_since = now
        return answer

    def _azure(self) -> Answer:
        if self.azure_names is None:
            names = {self.node, socket.gethostname()}
            status, body = self.http("GET", f"{self.base}/metadata/instance/compute/name"
                                     f"?api-version={AZURE_NAME_API}&format=text",
                                     {**self.agent, "Metadata": "true"}, self.timeout_s)
            name = body.decode("utf-8", "replace").strip()
            if status == 200 and name and len(name) <= 256:
                names = {name}   # the VM's own name is what Resources holds
            self.azure_names = frozenset(names)
        status, body = self.http("GET", f"{self.base}/metadata/scheduledevents?api-version={AZURE_API}",
                                 {**self.agent, "Metadata": "true"}, self.timeout_s)
        return parse_azure(status, body, self.azure_names, self.clock())


class NoticeWatch:
    """The polling thread of an agent: `take()` (the agent's loop, never blocking) returns the
    notices not yet taken, each once; problems are warned about once per kind."""

    def __init__(self, poller: Poller, *, every_s: float = POLL_S, warn: Callable[[str], None] | None = None) -> None:
        self.poller = poller
        self.every_s = every_s
        self.warn = warn or (lambda line: console.warning(line, err=True))
        self.found: "queue.SimpleQueue[Notice]" = queue.SimpleQueue()
        self.seen: set[tuple[str, str, int]] = set()
        self.warned: set[str] = set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"cloud-notice-{poller.cloud.value}", daemon=True)

    def start(self) -> "NoticeWatch":
        self.thread.start()
        return self

    def once(self) -> None:
        """One poll: a new notice queued, a new kind of problem warned about."""
        answer = self.poller.poll()
        if isinstance(answer, Notice) and answer.key() not in self.seen:
            self.seen.add(answer.key())
            self.found.put(answer)
        elif isinstance(answer, Problem) and answer.kind not in self.warned:
            self.warned.add(answer.kind)
            self.warn(f"ckptsup agent: {self.poller.cloud.value} preemption notices: {answer.text} "
                      "(said once; polling goes on)")

    def _run(self) -> None:
        while not self.stop.is_set():
            self.once()
            self.stop.wait(self.every_s)

    def take(self) -> list[Notice]:
        out = []
        while True:
            try:
                out.append(self.found.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=TIMEOUT_S)


def watch(setting: str, endpoints: Mapping[str, str], node: str, *, dmi_root: Path = DMI_ROOT) -> NoticeWatch | None:
    """The agent's watch for `[preemption] cloud_notice` (started), or None when nothing is polled."""
    cloud = resolve(setting, dmi_root)
    if cloud is None:
        return None
    endpoint = endpoints.get(cloud.value) or DEFAULT_ENDPOINTS[cloud]
    return NoticeWatch(Poller(cloud=cloud, endpoint=endpoint, node=node)).start()
