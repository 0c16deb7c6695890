"""Stage: audits of built images (`build.py audit`): one section per kind of finding.

``debian``: pending Debian security updates against the live security suite. A section is a
function ``(engine, target) -> SectionResult`` in :data:`builder.audit.sections.SECTIONS`; the verb
runs the ones asked for and writes one report with a result per image and section.
"""
