"""The program the `namespaces` sandbox runs as root inside its new namespaces (`sandbox.py`).

It runs as `python -I -c LAUNCHER PARAMS` and stays pid 1 of the pid namespace: when it exits, the
kernel kills whatever the program left running. It mounts the run's tmpfs /tmp with a copy of the
source, shows only the interpreter's directory through a private parent, keeps an interpreter that
lives under /tmp visible read-only, empties /dev/shm and /var/tmp, then forks the program with its
rlimits under an unused uid and writes the program's exit code or signal to the status file. A
self-contained string passed with `-c`: it imports only the standard library.
"""

LAUNCHER = r"""
import json, os, resource, shutil, subprocess, sys
p = json.loads(sys.argv[1])
status = open(p["status"], "w")
def mount(*args):
    subprocess.run(["mount", *args], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
box, uid = p["box"], p["uid"]
mount("-t", "tmpfs", "-o", "size=%dm,mode=1777" % p["disk_mb"], "tmpfs", box)
work = os.path.join(box, "work")
shutil.copytree(p["source"], work, symlinks=True)
for root, dirs, files in os.walk(work):
    for name in [root] + [os.path.join(root, n) for n in dirs + files]:
        os.lchown(name, uid, uid)
for blocked, child, stash in p["reveal"]:
    # `blocked` is not traversable by other users (e.g. /root holding the interpreter): show only
    # `child` through it, on an empty tmpfs, in this namespace only.
    os.makedirs(stash, exist_ok=True)
    mount("--bind", child, stash)
    mount("-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", blocked)
    os.makedirs(child, exist_ok=True)
    mount("--move", stash, child)
for path in p["keep"]:
    # The interpreter or its environment lives under /tmp (e.g. a checkout's .venv there): show it
    # at the same place on the new /tmp, read-only.
    target = os.path.join(box, os.path.relpath(path, "/tmp"))
    os.makedirs(target, exist_ok=True)
    mount("--bind", path, target)
    mount("-o", "remount,bind,ro", target)
mount("--move", box, "/tmp")
for path in ("/dev/shm", "/var/tmp"):
    if os.path.isdir(path):
        mount("-t", "tmpfs", "-o", "size=1m,mode=1777", "tmpfs", path)
pid = os.fork()
if pid == 0:
    try:
        limits = p["rlimits"]
        for name, (soft, hard) in limits.items():
            resource.setrlimit(getattr(resource, name), (soft, hard))
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        os.chdir("/tmp/work")
        os.execve(p["argv"][0], p["argv"], p["env"])
    except BaseException as error:
        sys.stderr.write("sandbox: cannot start the program: %r\n" % (error,))
    os._exit(127)
_, code = os.waitpid(pid, 0)
json.dump({"exit": os.WEXITSTATUS(code) if os.WIFEXITED(code) else None,
           "signal": os.WTERMSIG(code) if os.WIFSIGNALED(code) else None}, status)
status.close()
"""
