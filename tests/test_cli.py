import hashlib
import io

from serve_app import cli


def test_keys_new_prints_a_key_and_the_hash_of_that_key(capsys):
    assert cli.main(["keys", "new", "--tenant", "team-a"]) == 0
    out = capsys.readouterr().out
    key = next(w for w in out.split() if w.startswith("sk-forge-"))
    assert hashlib.sha256(key.encode()).hexdigest() in out
    assert "- name: team-a" in out


def test_keys_hash_reads_stdin(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("sk-demo\n"))
    assert cli.main(["keys", "hash"]) == 0
    assert capsys.readouterr().out.strip() == hashlib.sha256(b"sk-demo").hexdigest()
