"""What the documentation asks for agrees with the files it shows."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _worker_job(manifest: str) -> str:
    docs = [d for d in manifest.split("\n---\n") if "kind: Job" in d and '["worker"' in d]
    assert len(docs) == 1, "the manifest has one worker Job"
    return docs[0]


def test_kubernetes_worker_job_restarts_failed_workers_as_the_text_says() -> None:
    text = (ROOT / "docs" / "deploy.md").read_text()
    manifest = re.search(r"```yaml\n(.*?)```", text, re.S).group(1)
    job = _worker_job(manifest)
    # the text's advice, and the manifest following it: a host whose keeper exited is started
    # again (its island heals) instead of failing the Job at its first loss
    assert "`restartPolicy: OnFailure` and a `backoffLimit` above 0" in text
    assert re.search(r"^\s+restartPolicy: OnFailure$", job, re.M)
    assert int(re.search(r"^\s+backoffLimit: (\d+)$", job, re.M).group(1)) > 0
