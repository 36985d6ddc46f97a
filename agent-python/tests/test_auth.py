"""OOMSCOPE_TOKEN reaches a collector with --token-file from the Python
agent (its Rust reporter reads it) and from `oomscope.query`; without it the
collector stores nothing of the agent."""

import os
import subprocess
import sys

from conftest import free_port, oomscope_bin, wait_port

SECRET = "python-secret-0123456789"

CHILD = """
import oomscope
assert oomscope.start(collector=%r, name=%r, interval_s=0.05, exit_flush_s=0.3)
print("flushed", oomscope.flush(5))
print(oomscope.stats())
oomscope.stop()
"""


def test_the_python_agent_and_query_send_OOMSCOPE_TOKEN(tmp_path, monkeypatch):
    tokens = tmp_path / "tokens"
    tokens.write_text("py:%s\n" % SECRET)
    port = free_port()
    url = "http://127.0.0.1:%d" % port
    proc = subprocess.Popen([oomscope_bin(), "collector", "--listen", "127.0.0.1:%d" % port,
                             "--db", str(tmp_path / "c.db"), "--token-file", str(tokens)],
                            stdout=subprocess.DEVNULL)
    try:
        wait_port(port, proc=proc)
        env = dict(os.environ, OOMSCOPE_AUTOSTART="0")
        env.pop("OOMSCOPE_TOKEN", None)
        without = subprocess.run([sys.executable, "-c", CHILD % (url, "py-anonymous")], env=env,
                                 capture_output=True, text=True, timeout=60)
        assert "flushed False" in without.stdout, without.stdout + without.stderr
        with_token = subprocess.run([sys.executable, "-c", CHILD % (url, "py-authed")],
                                    env=dict(env, OOMSCOPE_TOKEN=SECRET),
                                    capture_output=True, text=True, timeout=60)
        assert "flushed True" in with_token.stdout, with_token.stdout + with_token.stderr

        import oomscope.query
        monkeypatch.delenv("OOMSCOPE_TOKEN", raising=False)
        try:
            oomscope.query.agents(url)
            raise AssertionError("a query without a token was answered")
        except Exception as e:  # the client's error, naming the fix
            assert "OOMSCOPE_TOKEN" in str(e), e
        monkeypatch.setenv("OOMSCOPE_TOKEN", SECRET)
        names = [a["hello"]["name"] for a in oomscope.query.agents(url)]
        assert names == ["py-authed"], names
    finally:
        proc.terminate()
        proc.wait(10)
