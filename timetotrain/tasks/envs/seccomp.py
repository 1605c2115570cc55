"""Seccomp filters for the code sandbox, as classic BPF programs (what `bwrap --seccomp FD` and
`prctl(PR_SET_SECCOMP)` load), written here with `struct` so no libseccomp is needed.

A program checks the audit architecture first (a syscall number means something else under another ABI,
so a foreign one kills the process), refuses x86_64's x32 ABI (numbers with bit 30 set), then returns EPERM
(or ENOSYS) for the syscalls a rule names and allows the rest. The syscall numbers are the kernel's
(arch/x86/entry/syscalls/syscall_64.tbl; include/uapi/asm-generic/unistd.h for aarch64).
"""

from __future__ import annotations

import errno
import platform
import struct
from dataclasses import dataclass

# BPF opcodes (linux/bpf_common.h) and seccomp return values (linux/seccomp.h)
_LD_W_ABS = 0x20
_JA, _JEQ, _JGE, _JSET = 0x05, 0x15, 0x35, 0x45
_RET = 0x06
ALLOW = 0x7FFF0000
KILL_PROCESS = 0x80000000
_ERRNO = 0x00050000
_X32_BIT = 0x40000000
_MAX_JUMP = 255  # a conditional jump's offset is one byte

# struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6] (little-endian: the low word first)
_NR, _ARCH = 0, 4


def _arg(i: int) -> int:
    return 16 + 8 * i


@dataclass(frozen=True)
class Arch:
    name: str
    audit: int  # AUDIT_ARCH_*
    x32: bool  # numbers with bit 30 set are another ABI here
    numbers: dict[str, int]


X86_64 = Arch(
    "x86_64", 0xC000003E, True,
    {"ioctl": 16, "socket": 41, "clone": 56, "execve": 59, "ptrace": 101, "syslog": 103, "uselib": 134,
     "personality": 135, "vhangup": 153, "pivot_root": 155, "chroot": 161, "acct": 163, "mount": 165,
     "umount2": 166, "swapon": 167, "swapoff": 168, "reboot": 169, "iopl": 172, "ioperm": 173,
     "init_module": 175, "delete_module": 176, "quotactl": 179, "kexec_load": 246, "add_key": 248,
     "request_key": 249, "keyctl": 250, "unshare": 272, "perf_event_open": 298, "open_by_handle_at": 304,
     "setns": 308, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312, "finit_module": 313,
     "kexec_file_load": 320, "bpf": 321, "execveat": 322, "userfaultfd": 323, "io_uring_setup": 425,
     "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428, "move_mount": 429, "fsopen": 430,
     "fsconfig": 431, "fsmount": 432, "fspick": 433, "clone3": 435, "pidfd_getfd": 438, "mount_setattr": 442},
)  # fmt: skip
AARCH64 = Arch(
    "aarch64", 0xC00000B7, False,
    {"ioctl": 29, "umount2": 39, "mount": 40, "pivot_root": 41, "chroot": 51, "vhangup": 58, "quotactl": 60,
     "acct": 89, "personality": 92, "unshare": 97, "kexec_load": 104, "init_module": 105,
     "delete_module": 106, "syslog": 116, "ptrace": 117, "reboot": 142, "socket": 198, "add_key": 217,
     "request_key": 218, "keyctl": 219, "clone": 220, "execve": 221, "swapon": 224, "swapoff": 225,
     "perf_event_open": 241, "open_by_handle_at": 265, "setns": 268, "process_vm_readv": 270,
     "process_vm_writev": 271, "kcmp": 272, "finit_module": 273, "bpf": 280, "execveat": 281,
     "userfaultfd": 282, "kexec_file_load": 294, "io_uring_setup": 425, "io_uring_enter": 426,
     "io_uring_register": 427, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
     "fsmount": 432, "fspick": 433, "clone3": 435, "pidfd_getfd": 438, "mount_setattr": 442},
)  # fmt: skip
ARCHES = {a.name: a for a in (X86_64, AARCH64)}


@dataclass(frozen=True)
class Rule:
    """Return `errno` for `syscall` when its argument `arg` passes `test` against `values` (no test: always).
    Tests: "ne" (the argument is none of the values), "eq" (it is one of them), "any" (it has a bit of
    values[0]). A syscall the architecture lacks is skipped (aarch64 has no iopl)."""

    syscall: str
    errno: int = errno.EPERM
    arg: int | None = None
    test: str = ""
    values: tuple[int, ...] = ()


AF_UNIX = 1
_NEW_NAMESPACES = (
    0x7E020080  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME
)
_TIOCSTI, _TIOCLINUX = 0x5412, 0x541C  # push input into, or drive, a terminal

# Reaching the kernel's larger surfaces, other processes' memory, other namespaces, or the host network.
_REFUSED = (
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount",
    "fspick", "mount_setattr", "open_by_handle_at", "unshare", "setns",
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "keyctl", "add_key", "request_key", "kexec_load", "kexec_file_load", "init_module", "finit_module",
    "delete_module", "personality", "syslog", "uselib", "vhangup", "swapon", "swapoff", "reboot", "acct",
    "quotactl", "iopl", "ioperm",
)  # fmt: skip
SANDBOX_RULES = (
    *(Rule(name) for name in _REFUSED),
    Rule("socket", arg=0, test="ne", values=(AF_UNIX,)),
    Rule("clone", arg=0, test="any", values=(_NEW_NAMESPACES,)),
    # clone3 passes its flags in memory a filter cannot read; ENOSYS makes glibc fall back to clone
    Rule("clone3", errno.ENOSYS),
    Rule("ioctl", arg=1, test="eq", values=(_TIOCSTI, _TIOCLINUX)),
)
# Loaded by the harness once the interpreter is up: the completion may not start another program.
NO_EXEC_RULES = (Rule("execve"), Rule("execveat"))


def host_arch() -> Arch:
    """This machine's architecture, or ValueError naming it (the tables know x86_64 and aarch64)."""
    machine = platform.machine()
    if machine not in ARCHES:
        raise ValueError(f"the sandbox's seccomp filter knows {' and '.join(ARCHES)}, not {machine}")
    return ARCHES[machine]


def program(rules: tuple[Rule, ...], arch: Arch) -> bytes:
    """The BPF program (struct sock_filter[]) that applies `rules` under `arch`."""
    ops: list[tuple] = [("ld", _ARCH), ("jeq", arch.audit, None, "kill"), ("ld", _NR)]
    if arch.x32:
        ops.append(("jge", _X32_BIT, f"errno{errno.EPERM}", None))
    for i, rule in enumerate(rules):
        if rule.syscall in arch.numbers:
            ops += _rule_ops(rule, arch.numbers[rule.syscall], f"next{i}")
    ops += [("label", "allow"), ("ret", ALLOW)]
    for code in sorted({errno.EPERM, *(r.errno for r in rules)}):
        ops += [("label", f"errno{code}"), ("ret", _ERRNO | code)]
    ops += [("label", "kill"), ("ret", KILL_PROCESS)]
    return _assemble(ops)


def _rule_ops(rule: Rule, nr: int, after: str) -> list[tuple]:
    """Jump to the rule's errno when it applies. A rule without a test falls through to the next one with
    the syscall number still loaded; one that loads its argument ends in a jump either way."""
    hit = f"errno{rule.errno}"
    if rule.arg is None:
        return [("jeq", nr, hit, None)]
    ops: list[tuple] = [("jeq", nr, None, after), ("ld", _arg(rule.arg))]
    if rule.test == "ne":
        ops += [("jeq", v, "allow", None) for v in rule.values] + [("ja", hit)]
    elif rule.test == "eq":
        ops += [("jeq", v, hit, None) for v in rule.values] + [("ja", "allow")]
    elif rule.test == "any":
        ops.append(("jset", rule.values[0], hit, "allow"))
    else:
        raise ValueError(f"unknown seccomp rule test {rule.test!r}")
    return [*ops, ("label", after)]


def _assemble(ops: list[tuple]) -> bytes:
    """Resolve labels into forward jumps and pack each instruction as struct sock_filter (u16, u8, u8, u32)."""
    where: dict[str, int] = {}
    code: list[tuple] = []
    for op in ops:
        if op[0] == "label":
            where[op[1]] = len(code)
        else:
            code.append(op)

    def offset(label: str | None, at: int) -> int:
        jump = 0 if label is None else where[label] - at - 1
        if not 0 <= jump <= _MAX_JUMP:
            raise ValueError(f"seccomp jump to {label} out of range ({jump})")
        return jump

    out = bytearray()
    for at, op in enumerate(code):
        if op[0] in ("ld", "ret"):
            out += struct.pack("=HBBI", _LD_W_ABS if op[0] == "ld" else _RET, 0, 0, op[1])
        elif op[0] == "ja":  # unconditional: the offset is k, 32 bits
            out += struct.pack("=HBBI", _JA, 0, 0, where[op[1]] - at - 1)
        else:
            opcode = {"jeq": _JEQ, "jge": _JGE, "jset": _JSET}[op[0]]
            out += struct.pack("=HBBI", opcode, offset(op[2], at), offset(op[3], at), op[1])
    return bytes(out)
