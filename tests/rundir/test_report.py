"""`grpokit report`: the HTML page and PNG plots of a real tiny-random run, opened in headless
Chromium; alerts drawn on the curves; a folder that is not a run gets a clear error."""

import base64
import json
import re
import shutil
import subprocess

import numpy as np
import pytest
from support.runs import completions_log
from support.synthetic import write_synthetic_run
from matplotlib.image import imread

from grpokit.cli import main
from grpokit.rundir.report import ALERT_COLOR

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
PLOTTED = {"reward", "grad_norm", "clip_ratio", "entropy", "completion_length", "learning_rate", "step_time"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A real 3-step tiny-random run (beta=0: no kl), its completions logged each step, reported."""
    out = tmp_path_factory.mktemp("report") / "run"
    assert main(["train", "--no-progress", "model.name=tiny-random", "train.prompts_per_step=2",
                 "rollout.num_generations=3", "data.eval_size=2", "train.max_steps=3", "train.eval_every=2",
                 "monitor.log_completions=1", f"train.output_dir={out}"]) == 0
    assert main(["report", str(out)]) == 0
    return out


def test_report_writes_every_plot_and_a_self_contained_page(run, capsys):
    pngs = {p.stem: p for p in (run / "plots").glob("*.png")}
    assert set(pngs) == PLOTTED  # every panel but kl, which beta=0 does not log
    page = (run / "report.html").read_text()
    # Self-contained: nothing fetched from elsewhere, no script.
    assert not re.search(r"<script|<link|src=\"(?!data:)|url\(", page)
    embedded = dict(re.findall(r'<img id="plot-([a-z_]+)" alt="[^"]*" src="data:image/png;base64,([^"]+)"', page))
    assert set(embedded) == PLOTTED
    for name, data in embedded.items():
        assert base64.b64decode(data) == pngs[name].read_bytes()
        image = imread(pngs[name])  # (height, width, RGBA)
        assert image.shape[1] == 750 and image.shape[0] in (320, 420)
        assert image[..., :3].std() > 0.05  # not a blank canvas
    assert "kl is logged only when algorithm.beta &gt; 0" in page
    # Sample completions: the logged steps' completions, escaped, with their rewards.
    samples = completions_log(run)
    assert {s["step"] for s in samples} == {1, 2, 3}
    for s in samples:
        text = s["completion"][0]["content"]
        assert text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;") in page
    assert "No alert was raised in 3 steps" in page
    assert "finished: 3 steps" in page


def test_report_is_regenerated_in_place(run):
    before = sorted(p.name for p in (run / "plots").iterdir())
    (run / "plots" / "kl.png").write_bytes(b"stale")  # as from an older run with beta > 0
    assert main(["report", str(run)]) == 0
    assert sorted(p.name for p in (run / "plots").iterdir()) == before
    assert not list(run.glob("*.tmp"))


@pytest.mark.process
@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (Debian: apt-get install chromium); "
                                             "`make test` installs it where it can")
def test_report_opens_in_headless_chromium_and_shows_the_plots(run, tmp_path):
    # A copy of the page with a probe: it records any error (a script error or a resource that fails
    # to load) and, once the page has loaded, which images decoded and at what size.
    probe = ("<script>window.__errors = []; addEventListener('error', e => __errors.push(String(e.message || "
             "(e.target && e.target.id) || 'error')), true); addEventListener('load', () => { "
             "const imgs = [...document.images]; document.body.setAttribute('data-probe', JSON.stringify({errors: "
             "__errors, images: imgs.map(i => [i.id, i.complete, i.naturalWidth, i.naturalHeight, i.width])}))});"
             "</script>")
    page = tmp_path / "probe.html"
    page.write_text((run / "report.html").read_text().replace("<head>", "<head>" + probe, 1))
    result = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
         "--window-size=1280,2000", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    console = [line for line in result.stderr.splitlines() if "CONSOLE" in line or "Failed to load" in line]
    assert not console, console
    probed = json.loads(re.search(r"data-probe=\"([^\"]*)\"", result.stdout).group(1).replace("&quot;", '"'))
    assert probed["errors"] == []
    images = {name: rest for name, *rest in probed["images"]}
    assert set(images) == {f"plot-{n}" for n in PLOTTED}
    for complete, width, height, shown in images.values():
        assert complete and width == 750 and height in (320, 420) and shown > 100  # decoded and on screen


def test_alerts_are_drawn_on_the_timeline_and_listed(tmp_path):
    from grpokit.rundir.diagnose import RunFacts, Watch
    from grpokit.settings.schema import Config

    run = tmp_path / "run"
    rows = write_synthetic_run(run, "grad_norm")
    assert main(["report", str(run)]) == 0
    quiet = imread(run / "plots" / "reward.png")
    watch = Watch(RunFacts.from_config(Config().to_dict()))
    alerts = [a for row in rows for a in watch.add(row)]
    (run / "alerts.jsonl").write_text("".join(a.to_json() + "\n" for a in alerts))
    assert main(["report", str(run)]) == 0
    page = (run / "report.html").read_text()
    assert "grad_norm median x" in page and "set algorithm.beta=0.001" in page
    magenta = np.array([int(ALERT_COLOR[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    for name in ("reward", "grad_norm", "kl"):  # every panel, not only the alert's own metric
        image = imread(run / "plots" / f"{name}.png")[..., :3]
        marked = np.abs(image - magenta).max(axis=-1) < 0.15
        assert marked.sum() > 50, name
    assert not (np.abs(quiet[..., :3] - magenta).max(axis=-1) < 0.15).any()


def test_report_names_a_folder_that_is_not_a_run(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "is not a grpokit run directory" in capsys.readouterr().err

