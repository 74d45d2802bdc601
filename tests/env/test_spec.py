"""The `uv_project` value: parsing, defaults, clear errors, the typed builder. No Ray."""

import pytest

from ray_uv_plugin.env.spec import (
    FIELD_NAMES,
    ParsedUvProject,
    UvProjectSpecError,
    UvProjectTypeError,
    parse_spec,
)
from ray_uv_plugin.registration import UvProject


def test_defaults_are_locked_default_groups_no_project_install():
    spec = parse_spec({})
    assert spec == ParsedUvProject()
    assert spec.sync_args() == ["--locked", "--no-install-project"]


def test_every_field_maps_to_uv_sync_flags():
    spec = parse_spec(
        {
            "project": "/p",
            "extras": ["vllm", "Flash_Attn"],
            "groups": ["test"],
            "no_default_groups": True,
            "frozen": True,
            "install_project": True,
        }
    )
    # As given (error messages show the user's own spelling), one per normalised name, sorted.
    assert spec.extras == ("Flash_Attn", "vllm")
    # The key sees normalised names: one venv per meaning.
    assert spec.selection()["extras"] == ["flash-attn", "vllm"]
    same = parse_spec({"extras": ["flash-attn", "VLLM", "vllm"]})
    assert same.selection()["extras"] == spec.selection()["extras"]
    assert spec.locked is False
    assert spec.sync_args() == [  # in the table's order of fields
        "--extra",
        "Flash_Attn",
        "--extra",
        "vllm",
        "--group",
        "test",
        "--no-default-groups",
        "--frozen",
    ]
    assert parse_spec({"all_extras": True}).sync_args()[0] == "--all-extras"
    assert parse_spec({"locked": False}).sync_args() == ["--no-install-project"]


def test_same_meaning_same_key_inputs():
    a, b = parse_spec({"extras": ["b", "a", "a"]}), parse_spec({"extras": ["A", "b"]})
    assert a.selection() == b.selection()


@pytest.mark.parametrize(
    ("value", "error", "words"),
    [
        ("vllm", UvProjectTypeError, "must be a dict"),
        (["vllm"], UvProjectTypeError, "must be a dict"),
        ({"extra": ["a"]}, UvProjectSpecError, "field(s) 'extra' (did you mean 'extras'?);"),
        ({"group": [], "zzz": 1}, UvProjectSpecError, "'group' (did you mean 'groups'?), 'zzz';"),
        ({"extras": "vllm"}, UvProjectTypeError, "extras must be a list of strings"),
        ({"groups": [1]}, UvProjectTypeError, "non-empty strings"),
        ({"extras": [""]}, UvProjectTypeError, "non-empty strings"),
        ({"locked": "yes"}, UvProjectTypeError, "locked must be true or false"),
        ({"project": 3}, UvProjectTypeError, "project must be a directory path"),
        ({"locked": True, "frozen": True}, UvProjectSpecError, "exclusive"),
        ({"all_extras": True, "extras": ["a"]}, UvProjectSpecError, "all_extras"),
    ],
)
def test_bad_values_name_the_part_and_the_fix(value, error, words):
    with pytest.raises(error) as info:
        parse_spec(value)
    assert words in str(info.value)
    assert isinstance(info.value, ValueError)


def test_type_errors_are_type_errors_too():
    with pytest.raises(TypeError):
        parse_spec({"extras": "x"})


@pytest.mark.parametrize("given", ["table", "", None, 3])
@pytest.mark.parametrize("field", ["extras", "no_extras", "groups", "only_groups", "no_groups"])
def test_every_list_field_refuses_a_string_whatever_the_way_in(field, given):
    """`UvProject(extras="table")` once became ['t', 'a', 'b', 'l', 'e']: the builder, the
    plain dict and `prepare_env`'s value all get the dict's own message."""
    from ray_uv_plugin.env.spec import keyword_value

    with pytest.raises(UvProjectTypeError) as parsed:
        parse_spec({field: given})
    with pytest.raises(UvProjectTypeError) as built:
        UvProject(**{field: given})
    assert str(built.value) == str(parsed.value)
    assert str(parsed.value).startswith(f"uv_project.{field} must be a list of strings, got ")
    if field in ("extras", "groups"):  # what prepare_env and `ray-uv check` take
        with pytest.raises(UvProjectTypeError) as prepared:
            parse_spec(keyword_value({field: given}))
        assert str(prepared.value) == str(parsed.value)


def test_typed_builder_takes_tuples_and_holds_lists():
    assert UvProject(extras=("b", "a"), groups=()) == {"extras": ["b", "a"]}


def test_typed_builder_is_a_plain_dict_of_non_defaults():
    value = UvProject(extras=["vllm"], frozen=True)
    assert value == {"extras": ["vllm"], "frozen": True}
    assert type(value).__mro__[1] is dict
    assert parse_spec(value).frozen
    assert UvProject() == {}
    assert set(UvProject(project="/p", groups=["g"], install_project=True)) <= set(FIELD_NAMES)
    with pytest.raises(UvProjectSpecError):
        UvProject(locked=True, frozen=True)


@pytest.mark.parametrize("given", [[], {}, 0, "", None])
@pytest.mark.parametrize("field", ["all_extras", "frozen", "install_project", "job_default"])
def test_a_flag_that_is_no_bool_is_refused_by_the_builder_as_by_the_dict(field, given):
    """Found by the spec fuzzer (tests/fuzz/spec.py): `UvProject(all_extras=[])` once made `{}`,
    a value the dict way refuses; only `False`, the default, is left out."""
    with pytest.raises(UvProjectTypeError, match=f"{field} must be true or false"):
        parse_spec({field: given})
    with pytest.raises(UvProjectTypeError, match=f"{field} must be true or false"):
        UvProject(**{field: given})
    assert UvProject(**{field: False}) == {}
