"""The environment as a value (ftlaunch.plan.environment): hash, comparison, lock text, planning notes."""

from __future__ import annotations

from ftlaunch.plan.environment import Environment, canonical, compare, default_notes, diff_table, lock_text


def env(**packages: str) -> Environment:
    base = {"torch": "2.6.0", "transformers": "4.49.0", "peft": "0.14.0", "six": "1.16.0", "pip": "25.0"}
    return Environment("/v/bin/python", "3.11.7", {**base, **packages}, system={"driver": "550.54", "gpus": ["A10G"]})


def test_hash_covers_the_packages_and_system_not_the_path_or_time():
    a = env()
    moved = Environment("/elsewhere/bin/python", "3.11.7", dict(a.packages), system=dict(a.system), recorded="t")
    assert a.digest() == moved.digest()
    assert a.digest() != env(six="1.17.0").digest()
    assert a.digest() != Environment(a.python, a.python_version, a.packages, system={"driver": "560.1"}).digest()
    assert Environment.from_json(a.to_json()).digest() == a.digest()


def test_compare_keeps_the_deciding_packages_apart():
    d = compare(env(), env(transformers="4.55.0", six="1.17.0", accelerate="1.3.0"))
    assert [(x.what, x.before, x.after) for x in d.deciding] == [
        ("accelerate", None, "1.3.0"),
        ("transformers", "4.49.0", "4.55.0"),
    ]
    assert [x.what for x in d.other] == ["six"] and d.system == ()
    assert d.summary() == "accelerate (none) -> 1.3.0, transformers 4.49.0 -> 4.55.0"
    table = diff_table(d.deciding).splitlines()
    assert table[0].split() == ["package", "before", "after"] and table[2].split() == [
        "transformers",
        "4.49.0",
        "4.55.0",
    ]
    assert not compare(env(), env()).changed


def test_a_new_commit_of_a_source_checkout_is_a_change():
    def lf(commit: str) -> Environment:
        src = {
            "llamafactory": {
                "url": "https://github.com/hiyouga/LLaMA-Factory.git",
                "vcs_info": {"vcs": "git", "commit_id": commit},
            }
        }
        return Environment("p", "3.11", {"llamafactory": "0.9.5"}, sources=src)

    d = compare(lf("a" * 40), lf("b" * 40))
    assert d.deciding[0].what == "llamafactory" and d.deciding[0].after == "0.9.5 (git bbbbbbbbbbbb)"


def test_system_changes_are_listed_apart():
    a = env()
    b = Environment(a.python, "3.12.1", a.packages, system={"driver": "560.1", "gpus": ["A10G"]})
    assert [x.what for x in compare(a, b).system] == ["python", "driver"] and not compare(a, b).deciding


def test_lock_pins_every_package_and_names_no_path_or_index():
    e = Environment(
        "/home/me/venv/bin/python",
        "3.11.7",
        {
            "torch": "2.6.0+cu124",
            "llamafactory": "0.9.5",
            "ftlaunch": "0.1.0",
            "six": "1.16.0",
            "pip": "25.0",
            "peft": "0.14.0",
        },
        sources={
            "llamafactory": {
                "url": "https://github.com/hiyouga/LLaMA-Factory.git",
                "vcs_info": {"vcs": "git", "commit_id": "c" * 40},
            },
            "ftlaunch": {"url": "file:///home/me/ftlaunch", "dir_info": {"editable": True}},
            "peft": {"url": "https://example.org/peft-0.14.0-py3-none-any.whl", "archive_info": {}},
        },
    )
    text = lock_text(e, "run X")
    lines = [x for x in text.splitlines() if x and not x.startswith("#")]
    assert lines == [
        f"llamafactory @ git+https://github.com/hiyouga/LLaMA-Factory.git@{'c' * 40}",
        "peft @ https://example.org/peft-0.14.0-py3-none-any.whl",
        "six==1.16.0",
        "torch==2.6.0",
    ]
    assert "/home/me" not in text and "--index-url" not in text.replace(
        "--extra-index-url https://download.pytorch.org", ""
    )
    assert "ftlaunch==0.1.0 was installed from an editable local directory" in text
    assert "download.pytorch.org/whl/cu124" in text and "python3.11 -m venv" in text


def test_canonical_names():
    assert canonical("Flash_Attn") == canonical("flash-attn") == canonical("flash.attn") == "flash-attn"


def test_notes_say_which_default_the_versions_decide():
    new = default_notes({}, {"transformers": "4.55.0", "torch": "2.8.0"})
    assert "adamw_torch_fused with transformers 4.55.0" in new[0] and "flash_attn is auto" in new[1]
    old = default_notes({"flash_attn": "sdpa"}, {"transformers": "4.49.0", "torch": "2.8.0"})
    assert len(old) == 1 and "optim is not set: the trainer's default decides, adamw_torch with" in old[0]
    assert "adamw_torch with" in default_notes({}, {"transformers": "4.55.0", "torch": "2.6.0+cu124"})[0]
    assert default_notes({"optim": "adamw_torch", "flash_attn": "fa2"}, {}) == []
    unknown = default_notes({}, {})  # a what-if for another machine: no '?' where a version would be
    assert "does not know the versions that will train" in unknown[0] and "?" not in " ".join(unknown)
    assert "the trainer's transformers picks" in unknown[1]
