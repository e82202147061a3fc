export function unknownFields() { return []; }
