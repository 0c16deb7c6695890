// An independent verifier: sigstore-js (@sigstore/verify) checks one DSSE envelope that `build.py publish
// --sign-key` stored in a cosign `.att` layer, with the public key only (no transparency log, no timestamps).
//
// sigstore-js verifies Sigstore bundles; it does not read an OCI registry or cosign's tag scheme. So the
// envelope, exactly as the registry serves it, is put into a bundle v0.3 (dsseEnvelope + a public-key hint),
// nothing of it changed, and the verifier is given that key as trust material.
//
// usage: node sigstore_verify.mjs NODE_MODULES ENVELOPE.json PUBLIC.pem
// prints "verified <payloadType>" and exits 0, or prints the error and exits 1.
import { createRequire } from "node:module";
import { readFileSync } from "node:fs";
import { createPublicKey } from "node:crypto";

const [modules, envelopePath, pubPath] = process.argv.slice(2);
const require = createRequire(modules + "/");
const { bundleFromJSON } = require("@sigstore/bundle");
const { Verifier, toSignedEntity, toTrustMaterial } = require("@sigstore/verify");

const envelope = JSON.parse(readFileSync(envelopePath, "utf8"));
const der = createPublicKey(readFileSync(pubPath, "utf8")).export({ type: "spki", format: "der" });
const hint = "ptmg-signing-key";
const bundle = bundleFromJSON({
  mediaType: "application/vnd.dev.sigstore.bundle.v0.3+json",
  verificationMaterial: { publicKey: { hint }, tlogEntries: [], timestampVerificationData: { rfc3161Timestamps: [] } },
  dsseEnvelope: envelope,
});
const trustedRoot = { mediaType: "application/vnd.dev.sigstore.trustedroot+json;version=0.1", tlogs: [],
  certificateAuthorities: [], ctlogs: [], timestampAuthorities: [] };
const keys = { [hint]: { rawBytes: der, keyDetails: "PKIX_ECDSA_P256_SHA_256", validFor: { start: new Date(0) } } };
try {
  const verifier = new Verifier(toTrustMaterial(trustedRoot, keys),
    { tlogThreshold: 0, ctlogThreshold: 0, timestampThreshold: 0 });
  verifier.verify(toSignedEntity(bundle));
  console.log(`verified ${envelope.payloadType}`);
} catch (err) {
  console.log(`FAILED: ${err.code || ""} ${err.message}`);
  process.exit(1);
}
